"""How far apart two sets of tensors ended: a side-by-side run's agreement with its reference.

Used by the benchmarks (``minitrain.bench``: FSDP, TP and the pipeline against torch's own) and
by chapter 4's measuring (``minitrain.ddp.measure``: each DataParallel variant against torch
DDP, notebook 04) — one definition for both, here below the techniques.
"""

from __future__ import annotations

import torch


def max_abs_difference(a: dict, b: dict) -> float:
    """The largest |a[name] - b[name]| over every element of every tensor of ``a`` (0.0 for an
    empty ``a``): how far apart two sets of full parameters ended (minitrain's and torch's
    after the same steps), or how far training moved them (``b`` the initial ones) — the
    second says whether the first's agreement means anything.

    ``b`` must hold each of ``a``'s names with the same shape (a name missing or a shape that
    would broadcast is an error naming it). Differences are taken in
    ``promote_types(dtype, float32)``: a bf16 difference would round away what it measures."""
    worst = 0.0
    for name, x in a.items():
        if name not in b:
            raise KeyError(f"max_abs_difference: {name!r} is in the first set, not the second")
        y = b[name]
        if x.shape != y.shape:
            raise ValueError(f"max_abs_difference: {name!r} has shape {tuple(x.shape)} in the "
                             f"first set, {tuple(y.shape)} in the second")
        if x.numel():
            wide = torch.promote_types(torch.promote_types(x.dtype, y.dtype), torch.float32)
            diff = x.detach().to(wide) - y.detach().to(device=x.device, dtype=wide)
            worst = max(worst, diff.abs().max().item())
    return worst
