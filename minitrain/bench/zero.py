"""Benchmark: training-step time of ZeRO stages 1-3 (and offload) relative to data parallelism.

    python -m minitrain.bench zero [--quick] [--world 2] [--steps 10] [--prefetch]

Trains the course's GPT with AdamW under ``minitrain.ddp.DataParallel`` (the reference: plain
DP, bucketed all-reduce overlapped with backward) and under ``minitrain.zero.ZeroDataParallel``
stages 1, 2, 3 and stages 2 and 3 with CPU offload, and under ``minitrain.fsdp`` in fp32 and
bf16 (gathers and compute in bf16), gloo, world 2, all in one launch. The
variants take turns step by step, so a slow moment of the machine hits them all alike; a
step's time is the slowest rank's; medians and ratios to DP are printed, with the bytes each
rank sent per step next to the ZeRO paper's volume (2Ψ or 3Ψ times (N-1)/N).

What to expect on a CPU: ZeRO trades memory for time. Stage 3 sends 1.5× DP's bytes and
launches two gathers per block per step, so it is slower; offload on a CPU-only machine moves
state from RAM to RAM, so it only adds copies (on a GPU it frees device memory for the price
of PCIe transfers). ``measure`` is also what notebook 05 calls.

``--prefetch`` (issue 42): stage 3 and FSDP on a modeled link sized so one block's all-gather
takes 0.8× its forward, with and without prefetch (``minitrain.fsdp.measure``), the measured
step and gather waits against the formula's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minitrain.bench import bench_parser, step_time_header, step_time_row
from minitrain.fsdp.measure import measure_prefetch
from minitrain.runtime import device_clock, get_device, launch, summarize_step_times

DP = "DP (minitrain.ddp)"
VARIANTS = {
    DP: None,
    "ZeRO-1": dict(stage=1),
    "ZeRO-2": dict(stage=2),
    "ZeRO-3": dict(stage=3),
    "ZeRO-2 + offload": dict(stage=2, offload=True),
    "ZeRO-3 + offload": dict(stage=3, offload=True),
    "FSDP": dict(fsdp=True),  # minitrain.fsdp: ZeRO-3 with an external AdamW
    "FSDP bf16": dict(fsdp=True, compute_dtype=torch.bfloat16),
}
MODEL = dict(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=256)  # 3.3 M parameters
QUICK_MODEL = dict(vocab_size=128, seq_len=32, n_layer=2, n_head=4, d_model=128)


def _rank_measure(variants, config, steps, batch, bucket_mb):
    from minitrain import zero
    from minitrain.ddp import DataParallel
    from minitrain.fsdp import FullyShardedDataParallel
    from minitrain.model import GPT, GPTConfig, lm_loss

    runners, device = {}, get_device()
    for name, kw in variants.items():
        torch.manual_seed(0)
        with torch.device(device):  # the model where this rank computes
            model = GPT(GPTConfig(**config))
        if kw is None or kw.get("fsdp"):
            if kw is None:
                dp = DataParallel(model, bucket_cap_mb=bucket_mb)
            else:
                dp = FullyShardedDataParallel(model, compute_dtype=kw.get("compute_dtype"))
            opt = torch.optim.AdamW(dp.parameters(), lr=1e-4)
            runners[name] = (dp, opt.step, opt.zero_grad)
        else:
            z = zero.ZeroDataParallel(
                model, torch.optim.AdamW, group=None, lr=1e-4, bucket_cap_mb=bucket_mb, **kw
            )
            runners[name] = (z, z.step, z.zero_grad)
    torch.manual_seed(1 + dist.get_rank())
    # data from the CPU generator (the same numbers on every device), moved explicitly
    x = torch.randint(0, config["vocab_size"], (batch, config["seq_len"]), device="cpu").to(device)
    y = torch.randint(0, config["vocab_size"], (batch, config["seq_len"]), device="cpu").to(device)
    times, sent = {name: [] for name in runners}, {}
    for step in range(steps + 2):  # two warm-up steps
        for name, (model, opt_step, zero_grad) in runners.items():
            dist.barrier()
            zero.reset_bytes_sent()
            start = device_clock(device)
            zero_grad()
            lm_loss(model(x), y).backward()
            opt_step()
            if step >= 2:
                times[name].append(device_clock(device) - start)
            sent[name] = zero.bytes_sent()["total"]
    padded = {
        name: m.padded_numel() for name, (m, _, _) in runners.items() if hasattr(m, "padded_numel")
    }
    return {"times": times, "sent": sent, "padded": padded}


def measure(
    variants=VARIANTS,
    config=MODEL,
    steps: int = 10,
    batch: int = 4,
    world: int = 2,
    bucket_mb: float = 1.0,
) -> dict:
    """{"step_time": {name: median of the slowest rank's step}, "spread": {name: its first and
    third quartiles}, "sent": {name: bytes rank 0 sent in one step}, "padded": {name: Ψ as
    stored, padding included}}."""
    res = launch(_rank_measure, world, variants, config, steps, batch, bucket_mb, timeout=900)
    return {
        **summarize_step_times([r["times"] for r in res]),
        "sent": res[0]["sent"],
        "padded": res[0]["padded"],
        "world": world,
    }


def report(result: dict, num_params: int) -> str:
    from minitrain.fsdp.measure import fsdp_formula
    from minitrain.zero import communication_formula

    base, world = result["step_time"][DP], result["world"]
    lines = [f"{step_time_header(18, 'DP')} {'sent/step (bytes)':>18} {'formula':>12}"]
    for name, t in result["step_time"].items():
        kw = VARIANTS.get(name) or {}
        stage = kw.get("stage", 3 if kw.get("fsdp") else 0)
        psi = result["padded"].get(name, num_params)
        # DP uses torch's all_reduce, which minitrain.zero does not count: formula only
        sent = f"{result['sent'][name]:,}" if stage else "(not counted)"
        formula = communication_formula(psi, world, stage)
        if kw.get("fsdp"):  # in bf16 the two gathers move 2-byte elements
            formula = fsdp_formula(psi, world, kw.get("compute_dtype"))["sent"]
        spread = result.get("spread", {}).get(name, (t, t))
        lines.append(f"{step_time_row(name, t, base, 18, 'DP', spread)} {sent:>18} {formula:>12,.0f}")
    return "\n".join(lines)


def report_prefetch(kind: str, run: dict) -> str:
    """``measure_prefetch``'s ratios: per variant the measured step and gather waits against
    ``predicted_step``'s; prefetch's waits against the waits without it."""
    from minitrain.runtime.link import describe

    lines = [f"{kind}: {describe(run['link'])}"]
    for name in ("prefetch", "exposed"):
        p, t, w = run["predicted"][name], run["step_time"][name], run["waited"][name]
        lines.append(f"  {name:>8}: step {t * 1e3:.1f} ms = {t / p['step']:.2f}× predicted, "
                     f"waited on gathers {w * 1e3:.1f} ms = {w / p['waits']:.2f}× predicted")
    w = run["waited"]
    lines.append(f"  waits with prefetch / without: {w['prefetch'] / w['exposed']:.2f} "
                 f"(predicted {run['predicted']['prefetch']['waits'] / run['predicted']['exposed']['waits']:.2f})")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = bench_parser("zero", __doc__, quick="smaller model, fewer steps", steps=(4, 10))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--prefetch", action="store_true",
                        help="only stage 3 and FSDP with and without prefetch on a modeled "
                             "link, against the formula (issue 42)")
    args = parser.parse_args(argv)
    if args.prefetch:
        for kind in ("zero3", "fsdp"):
            print(report_prefetch(kind, measure_prefetch(kind, steps=args.steps)))
        return 0
    config = QUICK_MODEL if args.quick else MODEL
    steps = args.steps
    from minitrain.model import GPTConfig, gpt_num_params

    n = gpt_num_params(GPTConfig(**config))
    print(
        f"GPT {config}: {n / 1e6:.2f} M parameters, AdamW, gloo world {args.world}, "
        f"median of {steps} steps (each the slowest rank's)\n"
    )
    print(report(measure(VARIANTS, config, steps, world=args.world), n))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
