"""Gradient clipping when no rank holds the whole gradient.

Chapter 5, notebooks/05_zero.ipynb; ``FullyShardedDataParallel.clip_grad_norm_``. Clipping
scales every gradient by min(1, max_norm / ‖g‖) with ‖g‖ the norm of the *whole* model's
gradient (Pascanu et al. 2013). Under FSDP rank r holds slice r of each unit's gradient, so
the square of the norm is a sum over ranks: each rank sums the squares of its slices, one
all-reduce adds them up (Zhao et al. 2023 list gradient clipping among what sharding changes). The
padding of the flat units is zero and adds nothing. Replicated parameters are whole on every
rank: their squares are added *after* the all-reduce, so they count once, not N times.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def clip_grad_norm_(fsdp, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of ``fsdp``'s shards in place; return the total norm before it."""
    if float(norm_type) != 2.0:
        raise ValueError(f"clip_grad_norm_: only norm_type=2.0 is supported, got {norm_type!r}")
    units = [u for u in fsdp.live_units() if u.master.grad is not None]
    ref = fsdp.live_units()[0].master
    acc = torch.promote_types(ref.dtype, torch.float32)  # bf16/fp16 -> fp32, fp64 stays fp64
    square = torch.zeros((), dtype=acc, device=ref.device)
    for u in units:
        if not u.keep_full:
            square += u.master.grad.to(acc).pow(2).sum()
    dist.all_reduce(square, group=fsdp.group)  # the slices of every rank
    for u in units:
        if u.keep_full:
            square += u.master.grad.to(acc).pow(2).sum()  # whole on every rank: once
    total = square.sqrt()
    # torch.nn.utils.clip_grad_norm_'s rule: the 1e-6 keeps a zero norm finite
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for u in units:
        u.master.grad.mul_(coef.to(u.master.grad.dtype))
    return total
