"""Benchmark: step time and measured bubble of each pipeline schedule, next to the formula.

    python -m minitrain.bench pipeline [--quick] [--repeats 5] [--pairs 10] [--peers-only]

Four measurements, one launch each (the first three: minitrain.pipeline.measure.run_pipelines):
1. the course's GPT, real compute, p = 2 ranks **on a modeled link** (``--link``, default the
   inter-node preset; minitrain.runtime.link): the measured step (slowest rank) against
   ``measure.predicted_step`` — ``simulate``'s rules with each action's measured time and
   α + n/β per activation or gradient — per step, the median ratio; target within 20 %;
2. a **calibrated-sleep stage** (no model: a forward sleeps ``unit``, a whole backward 2 units,
   the chapter's convention), p = 2: the timeline depends on the schedule alone, and the
   bubble must be within 10 % of the formula;
3. peak activation bytes per stage, GPT at p = 4, m = 8: measured (autograd's saved tensors)
   against the in-flight formula (the stage's action order times each chunk's bytes);
4. **peers side by side** (``--peers-only``: this section alone): GPipe and 1F1B against
   ``torch.distributed.pipelining``'s ``ScheduleGPipe`` / ``Schedule1F1B``, the GPT of
   section 1 (``--quick``: a smaller one), p = 2, m = 4 and 8: both medians, the median of the per-step ratios, the largest
   difference of the losses and of the parameters (minitrain.bench.pipeline_peer). Target
   (issue 33): ratio <= 1.05.
Formulas: (p-1)/(m+p-1) for GPipe and 1F1B (Huang et al. 2019; Narayanan et al. 2021),
(p-1)/(v*m+p-1) interleaved, ZB-H1's (p-1)(T_F+T_B-T_W) of idle time (Qi et al. 2024).
"""

from __future__ import annotations

import statistics

from minitrain.bench import bench_parser
from minitrain.bench.pipeline_peer import report as peer_report
from minitrain.bench.pipeline_peer import run_peers
from minitrain.pipeline.measure import run_pipelines
from minitrain.runtime.link import LINKS, describe

CONFIG = dict(vocab_size=128, seq_len=64, n_layer=4, n_head=4, d_model=128)
QUICK = dict(vocab_size=64, seq_len=32, n_layer=2, n_head=2, d_model=64)
CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1)]


def _label(name, v):
    return f"{name} (v={v})" if v > 1 else name


def main(argv=None) -> int:
    parser = bench_parser("pipeline", __doc__, quick="smaller sizes, fewer repeats")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=None,
                        help="measured steps of each peer pair (default 8 with --quick, else 10)")
    parser.add_argument("--link", default="inter-node", choices=list(LINKS),
                        help="the modeled link of section 1 (a preset)")
    parser.add_argument("--peers-only", action="store_true",
                        help="only section 4: minitrain against torch.distributed.pipelining")
    args = parser.parse_args(argv)
    repeats = 2 if args.quick else args.repeats
    pairs = args.pairs or (8 if args.quick else 10)
    if pairs < 1:
        parser.error(f"--pairs must be at least 1, got {pairs}")
    unit = 0.05 if args.quick else 0.1

    m = 4
    config, peer_config = CONFIG, QUICK if args.quick else CONFIG
    if args.peers_only:
        _peers(peer_config, pairs)
        return 0
    link = LINKS[args.link]
    real = run_pipelines("gpt", 2, m, CASES, batch=4 * m, config=config, repeats=repeats,
                         timeout=300, link=link)
    print(f"1. the course's GPT {config}, real compute, p = 2, m = {m}, on a modeled link "
          f"(medians of {repeats} steps; one message {1e3 * real[CASES[0]]['message_seconds']:.1f} ms)"
          f"\n   {describe(link)}")
    print(f"{'schedule':<18}{'compute only':>13}{'predicted':>11}{'measured':>10}{'ratio':>7}"
          f"{'within 20 %':>13}   (ms; ratio: median of measured/predicted per step)")
    for key, e in real.items():
        ratio = statistics.median(t / p for t, p in zip(e["step_seconds"], e["predicted_seconds"]))
        print(f"{_label(*key):<18}{1e3 * statistics.median(e['predicted_compute_only']):>13.1f}"
              f"{1e3 * statistics.median(e['predicted_seconds']):>11.1f}"
              f"{1e3 * statistics.median(e['step_seconds']):>10.1f}{ratio:>7.2f}"
              f"{abs(ratio - 1) <= 0.2!s:>13}")

    sleep = run_pipelines("sleep", 2, 2, CASES, unit=unit, repeats=max(3, repeats), timeout=300)
    print(f"\n2. calibrated-sleep stage (no model: a forward sleeps {1e3 * unit:.0f} ms, a whole "
          f"backward {2e3 * unit:.0f} ms), p = 2, m = 2")
    print(f"{'schedule':<18}{'bubble':>9}{'formula':>9}{'within 10 %':>13}")
    for key, e in sleep.items():
        ok = abs(e["measured_bubble"] - e["predicted_bubble"]) <= 0.1 * e["predicted_bubble"]
        print(f"{_label(*key):<18}{e['measured_bubble']:>9.3f}{e['predicted_bubble']:>9.3f}{ok!s:>13}")

    mem = run_pipelines("gpt", 4, 8, CASES[:3], batch=8,
                        config=dict(vocab_size=64, seq_len=32, n_layer=8, n_head=2, d_model=32),
                        timeout=300)
    print("\n3. peak activation bytes per stage, GPT, p = 4, m = 8: measured / in-flight formula")
    for key, e in mem.items():
        shown = ", ".join(f"{a}/{b}" for a, b in zip(e["peak_bytes"], e["predicted_peak_bytes"]))
        print(f"{_label(*key):<18}in flight {e['simulation'].peak_in_flight}: {shown}")
    print()
    _peers(peer_config, pairs)
    return 0


def _peers(config: dict, pairs: int) -> None:
    results = run_peers(config, pairs=pairs)
    print(f"4. minitrain against torch.distributed.pipelining, GPT {config}, p = 2, SGD, "
          f"4 sequences per micro-batch, {pairs} measured steps each")
    print(peer_report(results, pairs))


if __name__ == "__main__":
    raise SystemExit(main())
