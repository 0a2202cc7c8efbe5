"""Benchmark: training-step time of minitrain's DataParallel variants against torch DDP.

    python -m minitrain.bench ddp [--quick] [--world 2] [--bucket-mb 1]

Trains the course's GPT with every variant of ``minitrain.ddp.VARIANTS``, the bucketed
one also on the ring all-reduce, and torch's ``DistributedDataParallel`` with the same
bucket size (gloo, world 2). The variants take turns step by step, so a slow moment of
the machine hits them all alike; each step's time is the slowest rank's; medians are
printed with their ratio to torch DDP, and the share of communication time hidden
behind backward. Target (chapter 4): bucketed ≤ 1.15× torch DDP's step time.
``measure`` is also what notebook 04 and its widget call.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from minitrain.launch import launch

TORCH_DDP = "torch DDP"
MODEL = dict(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=256)  # 3.3 M parameters
QUICK_MODEL = dict(vocab_size=128, seq_len=32, n_layer=2, n_head=4, d_model=128)


def _build(name, kwargs, config, bucket_mb):
    from torch.nn.parallel import DistributedDataParallel

    from minitrain.ddp import DataParallel
    from minitrain.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**config))
    if name == TORCH_DDP:
        return DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    return DataParallel(model, **{"bucket_cap_mb": bucket_mb, **kwargs})


def _rank_measure(variants, config, bucket_mb, steps, batch):
    """Per variant: the step times (this rank) and the trace events of the last step."""
    from minitrain import trace
    from minitrain.model import lm_loss

    torch.manual_seed(1 + dist.get_rank())
    models = {name: _build(name, kw, config, bucket_mb) for name, kw in variants.items()}
    opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    x = torch.randint(0, config["vocab_size"], (batch, config["seq_len"]))
    y = torch.randint(0, config["vocab_size"], (batch, config["seq_len"]))
    times = {name: [] for name in models}
    last_events = {}
    for step in range(steps + 2):  # two warm-up steps
        for name, model in models.items():
            dist.barrier()
            trace.reset()
            start = time.perf_counter()
            with trace.span("forward", "compute"):
                loss = lm_loss(model(x), y)
            if name == TORCH_DDP:  # torch DDP records nothing itself: time its backward whole
                with trace.span("backward (with communication)", "compute"):
                    loss.backward()
            else:
                loss.backward()  # DataParallel records backward and each bucket's all-reduce
            with trace.span("optimizer", "compute"):
                opts[name].step()
                opts[name].zero_grad()
            elapsed = time.perf_counter() - start
            if step >= 2:
                times[name].append(elapsed)
            last_events[name] = trace.events()
    n_buckets = {name: len(m.buckets) for name, m in models.items() if name != TORCH_DDP}
    return {"times": times, "events": last_events, "buckets": n_buckets}


def measure(
    variants: dict,
    config=MODEL,
    bucket_mb: float = 1.0,
    steps: int = 10,
    batch: int = 2,
    world: int = 2,
) -> dict:
    """Run the variants side by side on ``world`` ranks.

    Returns {"step_time": {name: median over steps of the slowest rank's time},
    "traces": {name: [events of rank r in its last step]}, "buckets": {name: count}}.
    ``variants``: name → DataParallel keyword arguments; the name ``"torch DDP"`` means
    torch's DistributedDataParallel.
    """
    res = launch(_rank_measure, world, variants, config, bucket_mb, steps, batch, timeout=600)
    step_time = {
        name: statistics.median(max(r["times"][name][i] for r in res) for i in range(steps))
        for name in variants
    }
    traces = {name: [r["events"][name] for r in res] for name in variants}
    return {"step_time": step_time, "traces": traces, "buckets": res[0]["buckets"]}


def all_variants() -> dict:
    from minitrain.ddp import VARIANTS

    variants = dict(VARIANTS)
    variants["bucketed, overlapped"] = {"overlap": True}  # the benchmark's bucket size
    variants["bucketed, overlapped, ring"] = {"overlap": True, "communication": "ring"}
    variants[TORCH_DDP] = {}
    return variants


def report(result: dict) -> str:
    from minitrain.ddp import hidden_communication_share

    base = result["step_time"][TORCH_DDP]
    lines = [
        f"{'variant':<30} {'step (ms)':>9} {'vs torch DDP':>12} {'buckets':>7} {'comm hidden':>11}"
    ]
    for name, t in result["step_time"].items():
        buckets = result["buckets"].get(name, "")
        hidden = ""
        if name != TORCH_DDP:
            shares = [hidden_communication_share(evs) for evs in result["traces"][name]]
            hidden = f"{100 * statistics.mean(shares):5.0f} %"
        lines.append(f"{name:<30} {t * 1e3:9.1f} {t / base:11.2f}x {buckets!s:>7} {hidden:>11}")
    ratio = result["step_time"]["bucketed, overlapped"] / base
    lines.append(
        f"target bucketed <= 1.15x torch DDP: {'met' if ratio <= 1.15 else 'NOT met'} "
        f"({ratio:.2f}x)"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minitrain.bench ddp", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer steps")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args(argv)
    config = QUICK_MODEL if args.quick else MODEL
    steps = args.steps or (5 if args.quick else 15)
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
