"""Chapter 0 solutions — generated from minitrain.runtime.point_to_point.

The worked answers. Look one up when you are stuck; the library has them too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from minitrain.runtime.point_to_point import ring_neighbours


def pass_the_token(token: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Pass a token once around the ring; every rank adds ``rank + 1`` to it on the way.

    Rank 0 starts: it adds 1 to ``token`` and sends it to rank 1. Every other rank r
    receives the token from rank r-1, adds r+1 and sends it on to rank (r+1) mod N.
    Finally rank 0 receives it back from rank N-1. Return the token as this rank last
    held it: on rank 0 that is ``token + 1 + 2 + … + N``, the same number an
    all-reduce of ``rank + 1`` gives. With one rank, return ``token + 1``.

    ``token`` is not modified. Send and receive with ``dist.send`` / ``dist.recv``
    (``ring_neighbours`` gives the ranks to talk to).
    """
    ### BEGIN SOLUTION
    # HINT: rank 0 must send before it receives, every other rank receives first —
    # HINT: otherwise every rank waits in recv and nobody ever sends.
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    prev_rank, next_rank = ring_neighbours(group)
    held = token.clone()
    if world == 1:
        return held + 1
    if rank == 0:
        held += 1
        dist.send(held, next_rank, group=group)
        dist.recv(held, prev_rank, group=group)
    else:
        dist.recv(held, prev_rank, group=group)
        held += rank + 1
        dist.send(held, next_rank, group=group)
    return held
    ### END SOLUTION


def broadcast(tensor: torch.Tensor, src: int = 0,
              group: ProcessGroup | None = None) -> torch.Tensor:
    """Copy ``tensor`` from rank ``src`` to every rank, in place, using only send/recv.

    The simplest algorithm: ``src`` sends its tensor to each other rank in turn
    (N-1 sends from one rank: the root's link is the bottleneck — chapter 4 does
    better). Every other rank receives into ``tensor``. ``src`` is a global rank, as in
    ``dist.broadcast``. Returns ``tensor``. A ``src`` that is not a member of the group
    raises ``ValueError`` naming it: gloo would otherwise crash the process on a recv from
    a rank that does not exist.
    """
    ### BEGIN SOLUTION
    # HINT: dist.get_global_rank(group, i) turns a rank of the group into a global rank
    rank, world = dist.get_rank(), dist.get_world_size(group)
    members = [i if group is None else dist.get_global_rank(group, i) for i in range(world)]
    if src not in members:
        raise ValueError(f"broadcast: src rank {src} is not in the group {members}")
    if rank == src:
        for dst in members:
            if dst != src:
                dist.send(tensor, dst, group=group)
    else:
        dist.recv(tensor, src, group=group)
    return tensor
    ### END SOLUTION

# minitrain-exercises-hash: 462f311a4d947729
