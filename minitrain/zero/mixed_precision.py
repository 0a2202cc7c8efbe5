"""ZeRO in mixed precision: low-precision parameters to compute with, fp32 master shards to step.

Chapter 5, notebooks/05_zero.ipynb; used by ``ZeroDataParallel(compute_dtype=...)``.
Rajbhandari et al. 2020 (ZeRO) count the model states of mixed-precision Adam as 2Ψ (fp16
weights) + 2Ψ (fp16 gradients) + 12Ψ (fp32 master weights, momentum, variance); the recipe
is Micikevicius et al. 2018 ("Mixed Precision Training", §3.1): forward and backward in
fp16/bf16, the update in fp32 on a master copy, rounded back into the model after each step.
ZeRO shards the 12Ψ like the rest: rank r keeps the fp32 master of its slice only.

The choices made here:

- the flat unit (``FlatUnit.full``) and its ``shard`` hold the *compute* dtype: that is what
  forward reads and what stage 3 all-gathers (2 bytes per element on the wire);
- ``unit.master`` is an fp32 copy of the shard, made from the original fp32 weights (not from
  their rounded copy), and the optimizer steps it;
- gradients are summed in fp32: each low-precision gradient is cast to fp32 before it is
  reduce-scattered, so the N-way sum rounds once, at the end, and not at every hop of the ring.
"""

from __future__ import annotations

import torch

from minitrain.zero.buffers import FlatUnit


def cast_unit(unit: FlatUnit, dtype: torch.dtype, rank: int, own_shard: bool) -> None:
    """Re-pack ``unit`` in ``dtype``: a new flat ``full`` (each value rounded to nearest), the
    module's parameters re-pointed at views of it, and this rank's ``shard`` re-cut from it."""
    full = unit.full.detach().to(dtype)
    with torch.no_grad():
        for k, p in enumerate(unit.params):
            p.data = unit.slot(full, k).view(unit.shapes[k])  # now a view of the new buffer
    unit.full = full
    mine = full[rank * unit.shard_numel : (rank + 1) * unit.shard_numel]
    unit.shard = mine.clone() if own_shard else mine


def attach_master(
    unit: FlatUnit, compute_dtype, rank: int, own_shard: bool, host=None
) -> None:
    """Give ``unit`` its ``master``: the ``nn.Parameter`` an optimizer steps. Without a
    compute dtype and on the unit's device it *is* the shard (no copy); otherwise an fp32
    copy (on ``host`` if given), made before the unit is rounded to ``compute_dtype``, so the
    master keeps every digit of the fp32 weights."""
    dtype = unit.shard.dtype if compute_dtype is None else torch.float32
    separate = compute_dtype is not None or host is not None
    if host is not None:
        master = host_buffer(unit.shard, host, dtype)
        master.copy_(unit.shard.detach(), non_blocking=True)
        wait_for_host_copies(unit.shard.device)  # the host reads it from now on
    else:
        master = unit.shard.detach().to(unit.shard.device, dtype, copy=separate)
    unit.master = torch.nn.Parameter(master)
    if compute_dtype is not None:
        cast_unit(unit, compute_dtype, rank, own_shard)


def host_buffer(like: torch.Tensor, host, dtype=None) -> torch.Tensor:
    """A host tensor shaped as ``like`` for ZeRO-Offload (Ren et al. 2021): in pinned (page-
    locked) memory when ``like`` is on a GPU, so copies both ways are DMA transfers the host
    need not wait for (``non_blocking=True``); ordinary memory when it is on the CPU."""
    pinned = like.device.type == "cuda"
    return torch.empty(like.shape, dtype=dtype or like.dtype, device=host, pin_memory=pinned)


def wait_for_host_copies(device) -> None:
    """Copies to pinned memory run on ``device``'s current stream, after the kernels that made
    their data; the host waits for that stream once, before it reads the copies (the CPU
    optimizer), instead of once per copy. Nothing to wait for on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def cast_rest(module: torch.nn.Module, dtype: torch.dtype, sharded: set) -> None:
    """Cast what the units do not hold (frozen parameters, floating-point buffers such as
    running statistics) to ``dtype``, so the whole forward runs in one precision."""
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            if id(t) not in sharded and t.is_floating_point() and t.dtype != dtype:
                t.data = t.data.to(dtype)


def cast_inputs(value, dtype: torch.dtype):
    """Floating-point tensors in ``value`` (nested lists, tuples, dicts) cast to ``dtype``;
    token ids and everything else unchanged."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(cast_inputs(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_inputs(v, dtype) for k, v in value.items()}
    return value
