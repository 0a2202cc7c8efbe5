"""Benchmark of chapter 3: ``python -m minitrain.bench checkpointing [--layers 4 --batch 16 --repeats 20]``.

Prints, per policy on the tiny GPT, the bytes saved for backward, the peak of live saved
bytes, the matmul FLOPs of a step and its wall time, each next to its formula and relative
to no checkpointing (the measuring functions are minitrain.checkpointing.measure's), then
minitrain's full checkpointing timed against torch.utils.checkpoint, the reference.
"""

from __future__ import annotations

import copy

import torch

from minitrain.bench import bench_parser, print_table
from minitrain.checkpointing import set_checkpointing
from minitrain.checkpointing.measure import (
    POLICY_SET,
    compare_policies,
    interleaved_seconds,
    tiny_setup,
    train_step_once,
)


def _torch_checkpointed_blocks(blocks, x):
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    for block in blocks:
        x = torch_checkpoint(block, x, use_reentrant=True)
    return x


def torch_full_checkpointing(model):
    """The reference: the same model with torch's (reentrant) checkpoint around every block
    (as its ``block_loop``). Used only to time minitrain's ``checkpoint`` against torch's,
    never inside minitrain.
    """
    model = copy.deepcopy(model)
    model.block_loop = _torch_checkpointed_blocks
    return model


def main(argv=None) -> int:
    parser = bench_parser("checkpointing", __doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # steadier timings on a shared CPU; the ratios are what matters
    model, idx, targets = tiny_setup(
        args.layers, args.batch, seq_len=args.seq_len, d_model=args.d_model
    )
    print(
        f"tiny GPT: {args.layers} blocks, d_model={args.d_model}, seq_len={args.seq_len}, "
        f"batch={args.batch}, dropout=0.1, fp32, 1 thread; median of {args.repeats} "
        "forward+backward steps, policies timed in turns"
    )
    rows = compare_policies(model, idx, targets, POLICY_SET, args.repeats)
    for row in rows:
        row["formula ok"] = (
            row["saved"] == row["saved_formula"]
            and row["extra_flops"] == row["extra_flops_formula"]
        )
        row["ms"] = 1e3 * row["seconds"]
    print_table(
        rows,
        [
            "policy",
            "saved",
            "saved_ratio",
            "peak",
            "extra_flops",
            "flops_ratio",
            "ms",
            "time_ratio",
            "formula ok",
        ],
    )
    ours = set_checkpointing(copy.deepcopy(model), "full")
    theirs = torch_full_checkpointing(model)
    mine, ref = interleaved_seconds(
        [lambda: train_step_once(ours, idx, targets), lambda: train_step_once(theirs, idx, targets)], args.repeats
    )
    print(
        f"\nfull checkpointing, minitrain vs torch.utils.checkpoint(use_reentrant=True): "
        f"{1e3 * mine:.1f} ms vs {1e3 * ref:.1f} ms per step, ratio {mine / ref:.2f}"
    )
    return 0 if all(r["formula ok"] for r in rows) else 1
