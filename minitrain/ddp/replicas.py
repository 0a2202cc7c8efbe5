"""Replicas start equal: every rank wraps the same model and begins from the same weights.

Chapter 4, notebooks/04_collectives_and_data_parallel.ipynb. Data parallelism is exactly one
process on the global batch only if every rank's replica starts from identical parameters
(Li et al. 2020, "PyTorch Distributed", §3.2: DDP broadcasts rank 0's state at
construction). ``DataParallel`` (data_parallel.py) calls both functions; chapter 5's
``ZeroDataParallel`` and ``FullyShardedDataParallel`` start from rank 0's weights the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

BROADCAST_CHUNK_BYTES = 64 * 1024 * 1024  # at most this much copied at once (a large model's memory)


def broadcast_from_first_rank(module: nn.Module, group: ProcessGroup | None = None,
                              skip=()) -> None:
    """Make every rank's copy of ``module`` (parameters and buffers) equal to that of the
    group's first rank: replicas must start equal (chapter 4's DDP, chapter 5's ZeRO).
    ``skip``: parameters that are not replicas (an expert-parallel rank's own experts).

    One message per chunk of up to ``BROADCAST_CHUNK_BYTES`` of tensors of one dtype and
    device, not one per tensor: each collective pays the per-message latency α, and a model
    has hundreds of small tensors (torch DDP coalesces its start-up broadcast the same way)."""
    src = 0 if group is None else dist.get_global_rank(group, 0)
    skipped = {id(t) for t in skip}
    chunks: dict[tuple, list[torch.Tensor]] = {}  # (dtype, device) -> the open chunk
    filled: dict[tuple, int] = {}  # (dtype, device) -> the open chunk's bytes
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            if id(t) in skipped:
                continue
            kind = (t.dtype, t.device)
            chunks.setdefault(kind, []).append(t.data)
            filled[kind] = filled.get(kind, 0) + t.numel() * t.element_size()
            if filled[kind] >= BROADCAST_CHUNK_BYTES:
                _broadcast_flat(chunks.pop(kind), src, group)
                del filled[kind]
        for chunk in chunks.values():
            _broadcast_flat(chunk, src, group)


def _broadcast_flat(tensors: list[torch.Tensor], src: int, group) -> None:
    """Broadcast ``tensors`` (one dtype and device) as one flat message, copied back in place."""
    flat = torch.cat([t.reshape(-1) for t in tensors])  # on the tensors' own device
    dist.broadcast(flat, src, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def check_replicas_match(params: list[nn.Parameter], group: ProcessGroup | None = None) -> None:
    """Different models on different ranks would deadlock later: fail now, naming them.

    Compares the number of trainable parameters and of their elements over ``group``
    (every rank must call it, as a collective)."""
    mine = (len(params), sum(p.numel() for p in params))
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    if len(set(every)) > 1:
        raise ValueError(
            f"DataParallel: ranks wrap different models — (trainable "
            f"parameters, elements) per rank: {every}"
        )
