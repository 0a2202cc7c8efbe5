"""Benchmark: minitrain's FSDP against torch's FSDP2 (``fully_shard``), side by side.

    python -m minitrain.bench fsdp [--quick] [--world 2] [--steps 10]

Trains the course's GPT (3.3 M parameters; ``--quick``: a smaller one) with AdamW under
``minitrain.fsdp.FullyShardedDataParallel`` and under ``torch.distributed.fsdp.fully_shard``
(one unit per block, then the root, as torch's docs shard a transformer), gloo, in one
launch, from the same initial weights on the same batches. The two take turns step by
step, so a slow moment of the machine hits both alike; a step's time is the slowest rank's.
Prints both medians, the median of the per-step ratios (minitrain / torch; below 1: faster)
and the largest difference of the parameters after the last step. Target (issue 33): ≤ 1.0.
Chapter 5 (notebooks/05_zero.ipynb) quotes the ratio from a run.
"""

from __future__ import annotations

import copy
import statistics

import torch
import torch.distributed as dist

from minitrain.bench import bench_parser, max_abs_difference
from minitrain.runtime import launch, slowest_rank_seconds

MODEL = dict(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=256)  # 3.3 M parameters
QUICK_MODEL = dict(vocab_size=128, seq_len=32, n_layer=2, n_head=4, d_model=128)


def _rank(config: dict, steps: int, batch: int):
    from torch.distributed.fsdp import fully_shard

    from minitrain.fsdp import FullyShardedDataParallel
    from minitrain.model import GPT, GPTConfig, lm_loss

    torch.manual_seed(0)
    dense = GPT(GPTConfig(**config))
    ours = FullyShardedDataParallel(copy.deepcopy(dense))
    theirs = copy.deepcopy(dense)
    for block in theirs.blocks:
        fully_shard(block)
    fully_shard(theirs)
    opts = {
        "minitrain": torch.optim.AdamW(ours.parameters(), lr=1e-3),
        "torch": torch.optim.AdamW(theirs.parameters(), lr=1e-3),
    }
    models = {"minitrain": ours, "torch": theirs}

    def train_step(name, x, y):
        model = models[name]
        lm_loss(model(x), y).backward()
        if name == "minitrain":
            model.finish_gradient_synchronization()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)

    gen = torch.Generator(device="cpu").manual_seed(1 + dist.get_rank())
    times = {name: [] for name in models}
    for step in range(steps + 1):  # step 0 warms up both
        x = torch.randint(0, config["vocab_size"], (batch, config["seq_len"]), generator=gen, device="cpu")
        y = torch.randint(0, config["vocab_size"], (batch, config["seq_len"]), generator=gen, device="cpu")
        for name in models:
            seconds, _ = slowest_rank_seconds(train_step, name, x, y)  # the slowest rank's step
            if step:
                times[name].append(seconds)
    full_theirs = {name: p.full_tensor() if hasattr(p, "full_tensor") else p
                   for name, p in theirs.named_parameters()}
    initial = dict(dense.named_parameters())
    return (times, max_abs_difference(full_theirs, ours.full_state_dict()),
            max_abs_difference(full_theirs, initial))


def run(config: dict, steps: int, world: int = 2, batch: int = 4) -> dict:
    times, worst, moved = launch(_rank, world, config, steps, batch, timeout=1200)[0]
    ratios = [a / b for a, b in zip(times["minitrain"], times["torch"])]
    return {"minitrain ms": 1e3 * statistics.median(times["minitrain"]),
            "torch ms": 1e3 * statistics.median(times["torch"]),
            "ratio": statistics.median(ratios), "max |diff|": worst, "moved": moved}


def main(argv=None) -> int:
    parser = bench_parser("fsdp", __doc__, quick="a smaller GPT, fewer steps", steps=(8, 12))
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args(argv)
    config = QUICK_MODEL if args.quick else MODEL
    r = run(config, args.steps, args.world)
    print(f"GPT {config}, AdamW, gloo world {args.world}, median of {args.steps} steps")
    print(f"minitrain FSDP {r['minitrain ms']:.1f} ms | torch fully_shard {r['torch ms']:.1f} ms | "
          f"ratio {r['ratio']:.2f}x (target <= 1.0) | max |param diff| {r['max |diff|']:.2e} "
          f"(parameters moved by up to {r['moved']:.2e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
