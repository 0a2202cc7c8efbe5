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


def broadcast_from_first_rank(module: nn.Module, group: ProcessGroup | None = None,
                              skip=()) -> None:
    """Make every rank's copy of ``module`` (parameters and buffers) equal to that of the
    group's first rank: replicas must start equal (chapter 4's DDP, chapter 5's ZeRO).
    ``skip``: parameters that are not replicas (an expert-parallel rank's own experts)."""
    src = 0 if group is None else dist.get_global_rank(group, 0)
    skipped = {id(t) for t in skip}
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            if id(t) not in skipped:
                dist.broadcast(t.data, src, group=group)


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
