"""Benchmark: training-step time of minitrain's DataParallel variants against torch DDP.

    python -m minitrain.bench ddp [--quick] [--world 2] [--bucket-mb 1] [--batch 2]
                                  [--link PRESET]

Trains the course's GPT with every variant of ``minitrain.ddp.VARIANTS``, the bucketed
one also on the ring all-reduce, and torch's ``DistributedDataParallel`` with the same
bucket size (gloo, world 2), all from the same initial weights on the same batches. The
variants take turns step by step, so a slow moment of the machine hits them all alike;
each step's time is the slowest rank's, timed on untraced steps (timelines and the hidden
share come from traced steps taken in turn: recording costs DataParallel a few per cent).
Printed per variant: the median step time, its ratio to torch DDP's median, the median of the per-step ratios (each step against torch
DDP's step of the same round: the number to quote), the share of communication time hidden
behind backward, and the largest difference of its parameters from torch DDP's after the
last step next to how far they moved. Target (issue 33): bucketed, overlapped ≤ 1.05×
torch DDP (the median of the per-step ratios).
The measuring itself is minitrain.ddp.measure's, which notebook 04 and its widget call.

``--link PRESET`` (issue 42): the DataParallel variants on a modeled link
(``minitrain.runtime.link``; a preset of ``LINKS``, or ``backward``: the link on which one
all-reduce of the gradients takes as long as the unmodeled backward, notebook 04's), torch
DDP left out (not modeled). Printed besides the table: bucketed, overlapped / flat after
backward (target <= 0.8x) and its gain against the one the traces predict (within 20 %).
"""

from __future__ import annotations

import statistics

from minitrain.bench import bench_parser, step_time_header, step_time_row
from minitrain.ddp.measure import (
    MODEL,
    QUICK_MODEL,
    TORCH_DDP,
    hidden_communication_share,
    measure,
    predicted_gain,
    summarize_shares,
)


def all_variants() -> dict:
    from minitrain.ddp import VARIANTS

    variants = dict(VARIANTS)
    variants["bucketed, overlapped"] = {"overlap": True}  # the benchmark's bucket size
    variants["bucketed, overlapped, ring"] = {"overlap": True, "communication": "ring"}
    variants[TORCH_DDP] = {}
    return variants


TARGET = 1.05  # bucketed, overlapped / torch DDP, median of the per-step ratios (issue 33)


def report(result: dict, reference: str = TORCH_DDP) -> str:
    """The table: one row per variant, ratios against ``reference``; the last line says whether
    the target is met (against torch DDP only). ``result``: ``measure``'s (older results
    without per-step ratios or differences print blanks there)."""
    base = result["step_time"][reference]
    ratios, diffs = result.get("step_ratio", {}), result.get("max_diff", {})
    lines = [
        f"{step_time_header(30, reference, spread=False)} {'per step':>8} {'buckets':>7} "
        f"{'comm hidden: median (quartiles)':>32} {'max |diff|':>10} {'moved':>8}"
    ]
    for name, t in result["step_time"].items():
        buckets = result["buckets"].get(name, "")
        hidden = ""
        if name != TORCH_DDP:
            if "hidden_shares" in result:
                shares = result["hidden_shares"][name]
            else:  # one step's traces only
                shares = [statistics.mean(hidden_communication_share(e) for e in result["traces"][name])]
            st = summarize_shares(shares)
            hidden = (
                f"{100 * st['median']:3.0f} % ({100 * st['q1']:3.0f}-{100 * st['q3']:3.0f} %, "
                f"{st['steps']} steps)"
            )
        per_step = f"{ratios[name]:7.2f}x" if name in ratios else ""
        diff = f"{diffs[name]:10.1e}" if name in diffs else ""
        moved = f"{result['moved'][name]:8.1e}" if name in result.get("moved", {}) else ""
        lines.append(f"{step_time_row(name, t, base, 30, reference)} {per_step:>8} {buckets!s:>7} "
                     f"{hidden:>32} {diff:>10} {moved:>8}")
    key = "bucketed, overlapped"
    if reference == TORCH_DDP and key in result["step_time"]:
        ratio = ratios.get(key, result["step_time"][key] / base)
        how = "median of the per-step ratios" if key in ratios else "ratio of the medians"
        lines.append(
            f"target bucketed, overlapped <= {TARGET}x torch DDP: "
            f"{'met' if ratio <= TARGET else 'NOT met'} ({ratio:.2f}x, {how})"
        )
    return "\n".join(lines)


FLAT, BUCKETED = "flat, after backward", "bucketed, overlapped"
LINK_TARGET, GAIN_TOLERANCE = 0.8, 0.2  # issue 42: bucketed <= 0.8x flat, gain within 20 %


def overlap_verdict(result: dict) -> dict:
    """On a modeled link: bucketed, overlapped against one flat bucket after backward —
    {"ratio": median of the per-step ratios, "gain": median of flat - bucketed per step (s),
    "predicted": the gain the traces predict (``predicted_gain``), "beat", "target",
    "as_predicted": the three checks of issue 42}. ``result``: ``measure(...,
    reference=FLAT)``'s with both variants."""
    ratio = result["step_ratio"][BUCKETED]
    slowest = result["slowest"]
    gain = statistics.median(a - b for a, b in zip(slowest[FLAT], slowest[BUCKETED]))
    predicted = predicted_gain(result, FLAT, BUCKETED)
    return {"ratio": ratio, "gain": gain, "predicted": predicted, "beat": ratio < 1,
            "target": ratio <= LINK_TARGET,
            "as_predicted": predicted > 0 and abs(gain / predicted - 1) <= GAIN_TOLERANCE}


def link_variants() -> dict:
    """What ``--link`` compares (torch DDP left out: its reducer calls gloo from C++, under
    the link, so its messages would not be modeled)."""
    from minitrain.ddp import VARIANTS

    return {**VARIANTS, BUCKETED: {"overlap": True}}  # the benchmark's bucket size


def main(argv=None) -> int:
    parser = bench_parser("ddp", __doc__, quick="smaller model, fewer steps", steps=(5, 15))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    parser.add_argument("--link", metavar="PRESET", default=None,
                        help="on a modeled link: a preset of minitrain.runtime.link.LINKS, or "
                             "'backward' (one all-reduce of the gradients = backward's time)")
    args = parser.parse_args(argv)
    config = QUICK_MODEL if args.quick else MODEL
    steps = args.steps
    from minitrain.model import GPTConfig, gpt_num_params

    n = gpt_num_params(GPTConfig(**config))
    print(
        f"GPT {config}: {n / 1e6:.2f} M parameters, {4 * n / 2**20:.1f} MB of fp32 gradients; "
        f"gloo world {args.world}, bucket {args.bucket_mb} MB, batch {args.batch} per rank, "
        f"median of {steps} steps\n"
    )
    if args.link is None:
        print(report(measure(all_variants(), config, args.bucket_mb, steps, args.batch,
                             args.world)))
        return 0
    return _on_link(args, config, steps, 4 * n)


def _on_link(args, config, steps, gradient_bytes) -> int:
    from minitrain.collectives.cost_model import link_for_overlap
    from minitrain.runtime.link import describe, resolve

    if args.link == "backward":  # sized in the run, to this machine's unmodeled backward
        def link(backward):
            return link_for_overlap(backward, gradient_bytes, args.world)
    else:
        link = resolve(args.link)
    result = measure(link_variants(), config, args.bucket_mb, steps, args.batch, args.world,
                     link=link, reference=FLAT)
    link = result["link"]
    print(describe(link))
    print("(torch DDP is left out: its messages do not go through the modeled link)\n")
    print(report(result, reference=FLAT))
    v = overlap_verdict(result)
    print(f"\nbucketed, overlapped / flat after backward: {v['ratio']:.2f}x (median of the "
          f"per-step ratios; target <= {LINK_TARGET}x: {'met' if v['target'] else 'NOT met'})")
    print(f"gain per step: measured {v['gain'] * 1e3:.1f} ms, predicted by the traces "
          f"{v['predicted'] * 1e3:.1f} ms (exposed communication, flat - bucketed): "
          f"{'within' if v['as_predicted'] else 'NOT within'} {GAIN_TOLERANCE:.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
