"""Benchmark: an expert-parallel MoE layer over 2 ranks against the local layer on one
process, and the bytes its all-to-alls send against the formula.

    python -m minitrain.bench moe [--quick] [--steps 10]

The same MoE layer (same weights) runs one forward + backward + AdamW step on the same
global batch of tokens:
- local, one process: rank 0 alone runs all 2T tokens (rank 1 waits at a barrier);
- EP-2: ``ExpertParallelMoE`` over 2 ranks, each routing its T tokens, half of the experts
  on each rank, two all-to-alls forward and two backward.
They take turns step by step, so a slow moment of the machine hits both alike; a step's time
is the slowest rank's, and the median over steps is printed with the quartiles.

Bytes (per rank and step, logical: rows sent to the *other* rank, counted by
``minitrain.moe.all_to_all``) against T · k · d_model · 4 · (P−1)/P per all-to-all (GShard,
Lepikhin et al. 2020, section 2.2), which assumes uniform routing.
What to expect on a 2-core CPU: each rank holds half the experts and half the tokens, so
the expert compute halves, but the all-to-alls and the count exchange sit on the critical
path; on GPUs, EP is how a model with more experts than fit on one device is trained.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from minitrain.bench import bench_parser, step_time_header, step_time_row
from minitrain.runtime import device_clock, get_device, launch, summarize_step_times

LOCAL, EP = "local, 1 process", "EP-2 (ExpertParallelMoE)"
SIZE = dict(tokens=2048, d_model=256, d_ff=1024, num_experts=8, top_k=2)
QUICK = dict(tokens=256, d_model=64, d_ff=256, num_experts=4, top_k=2)


def _rank_measure(size, steps):
    from minitrain.moe import (
        ExpertParallelMoE,
        MoELayer,
        communication_log,
        reset_communication_log,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    device = get_device()
    with torch.device(device):  # the layer where this rank computes
        local = MoELayer(size["d_model"], size["d_ff"], size["num_experts"], size["top_k"])
    layers = {LOCAL: copy.deepcopy(local), EP: ExpertParallelMoE.from_local(local)}
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-3) for n, m in layers.items()}
    g = torch.Generator(device="cpu").manual_seed(1)  # data from the CPU generator, moved
    x = torch.randn(size["tokens"], size["d_model"], generator=g, device="cpu").to(device)
    per = x.shape[0] // world
    # inputs that need a gradient, as inside a network: all four all-to-alls run
    inputs = {LOCAL: x.clone().requires_grad_(),
              EP: x[rank * per:(rank + 1) * per].clone().requires_grad_()}
    times, sent = {n: [] for n in layers}, {}
    for step in range(steps + 2):  # two warm-up steps
        for name, layer in layers.items():
            dist.barrier()
            if name == LOCAL and rank != 0:
                continue
            reset_communication_log()
            start = device_clock(device)
            opts[name].zero_grad()
            (layer(inputs[name]).square().mean() + layer.aux_loss).backward()
            if name == EP:
                layer.finish_gradient_synchronization()
            opts[name].step()
            if step >= 2:
                times[name].append(device_clock(device) - start)
            if name == EP:
                sent = {}
                for what, nbytes in communication_log():
                    sent[what] = sent.get(what, 0) + nbytes
    return {"times": times, "sent": sent, "tokens": per}


def measure(size=SIZE, steps: int = 10) -> dict:
    from minitrain.moe.measure import all_to_all_bytes_formula

    res = launch(_rank_measure, 2, size, steps, timeout=900)
    return {
        **summarize_step_times([r["times"] for r in res]),
        "sent": [r["sent"] for r in res],
        "formula": all_to_all_bytes_formula(res[0]["tokens"], size["top_k"], size["d_model"],
                                            4, 2),
    }


def report(result: dict) -> str:
    base = result["step_time"][LOCAL]
    lines = [step_time_header(26, "local")]
    for name, t in result["step_time"].items():
        lines.append(step_time_row(name, t, base, 26, "local", result["spread"][name]))
    lines.append("")
    lines.append(f"all-to-all bytes per rank and step (formula T·k·d·4·(P−1)/P = "
                 f"{result['formula']:,.0f} each):")
    for rank, sent in enumerate(result["sent"]):
        parts = ", ".join(f"{k} {v:,} ({v / result['formula']:.3f}x)" for k, v in sent.items())
        lines.append(f"  rank {rank}: {parts}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = bench_parser("moe", __doc__, quick="smaller layer, fewer steps", steps=(4, 10))
    args = parser.parse_args(argv)
    size = QUICK if args.quick else SIZE
    steps = args.steps
    print(f"MoE layer {size} (tokens: the global batch), AdamW, gloo, median of {steps} steps "
          "(each the slowest rank's)\n")
    print(report(measure(size, steps)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
