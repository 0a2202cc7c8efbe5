"""Benchmark: training-step time of minitrain's DataParallel variants against torch DDP.

    python -m minitrain.bench ddp [--quick] [--world 2] [--bucket-mb 1]

Trains the course's GPT with every variant of ``minitrain.ddp.VARIANTS``, the bucketed
one also on the ring all-reduce, and torch's ``DistributedDataParallel`` with the same
bucket size (gloo, world 2). The variants take turns step by step, so a slow moment of
the machine hits them all alike; each step's time is the slowest rank's; medians are
printed with their ratio to torch DDP, and the share of communication time hidden
behind backward. Target (chapter 4): bucketed ≤ 1.15× torch DDP's step time.
The measuring itself is minitrain.ddp.measure's, which notebook 04 and its widget call.
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
    summarize_shares,
)


def all_variants() -> dict:
    from minitrain.ddp import VARIANTS

    variants = dict(VARIANTS)
    variants["bucketed, overlapped"] = {"overlap": True}  # the benchmark's bucket size
    variants["bucketed, overlapped, ring"] = {"overlap": True, "communication": "ring"}
    variants[TORCH_DDP] = {}
    return variants


def report(result: dict) -> str:
    base = result["step_time"][TORCH_DDP]
    lines = [
        f"{step_time_header(30, TORCH_DDP, spread=False)} {'buckets':>7} "
        f"{'comm hidden: median (quartiles)':>32}"
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
        lines.append(f"{step_time_row(name, t, base, 30, TORCH_DDP)} {buckets!s:>7} {hidden:>32}")
    ratio = result["step_time"]["bucketed, overlapped"] / base
    lines.append(
        f"target bucketed <= 1.15x torch DDP: {'met' if ratio <= 1.15 else 'NOT met'} "
        f"({ratio:.2f}x)"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = bench_parser("ddp", __doc__, quick="smaller model, fewer steps", steps=(5, 15))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    args = parser.parse_args(argv)
    config = QUICK_MODEL if args.quick else MODEL
    steps = args.steps
    result = measure(all_variants(), config, args.bucket_mb, steps, world=args.world)
    from minitrain.model import GPTConfig, gpt_num_params

    n = gpt_num_params(GPTConfig(**config))
    print(
        f"GPT {config}: {n / 1e6:.2f} M parameters, {4 * n / 2**20:.1f} MB of fp32 gradients; "
        f"gloo world {args.world}, bucket {args.bucket_mb} MB, median of {steps} steps\n"
    )
    print(report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
