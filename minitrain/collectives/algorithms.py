"""Naive and recursive-doubling all-reduce, the bytes each algorithm sends, and ``all_reduce``
by name — the two algorithms notebook 04 compares with the ring (``ring.py``).

Used by notebooks/04_collectives_and_data_parallel.ipynb and ``python -m minitrain.bench
allreduce``, through ``minitrain.collectives``. The algorithms and their costs are described
in the package's docstring (``minitrain/collectives/__init__.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from minitrain.collectives.auto import LinkCost, LinkCostCache, choose_algorithm, resolve_link
from minitrain.collectives.exchange import chunk_sizes, exchange, scratch_buffers

# the send/receive helpers under the short names the algorithms below were written with
from minitrain.collectives.exchange import flat_view as _flat
from minitrain.collectives.exchange import global_rank as _global
from minitrain.collectives.exchange import recv_nonempty as _recv
from minitrain.collectives.exchange import send_counted as _send
from minitrain.collectives.pipelined import ring_all_reduce_pipelined
from minitrain.collectives.ring import ring_all_reduce


def naive_all_reduce(tensor: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks, in place: reduce to rank 0 of the group, then broadcast.

    The root receives N-1 tensors, adds them in rank order and sends the sum to N-1
    ranks: it sends (N-1)·n elements, every other rank n. Returns ``tensor``.
    """
    flat = _flat(tensor, "naive_all_reduce", "tensor")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    root = _global(group, 0)
    if rank == 0:
        incoming = scratch_buffers(flat.numel(), flat)[0]  # reused: no page faults per call
        for other in range(1, world):
            _recv(incoming, _global(group, other), group)
            flat.add_(incoming)
        for other in range(1, world):
            _send(flat, _global(group, other), group)
    else:
        _send(flat, root, group)
        _recv(flat, root, group)
    return tensor


def recursive_doubling_all_reduce(tensor: torch.Tensor,
                                  group: ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks, in place, in log2(N) steps of whole-tensor swaps.

    With N a power of two, at step k rank r swaps its partial sum with rank r XOR 2^k
    and both add: after log2 N steps all hold the total. Other N (Thakur et al. 2005,
    §4.3): with P the largest power of two ≤ N and e = N - P, the first 2e ranks pair
    up; each even one hands its tensor to its odd neighbour and waits, the P remaining
    ranks run the power-of-two algorithm, then the odd ones hand the result back.
    Both partners compute a + b, which IEEE addition makes bitwise equal to b + a, so
    every rank ends with the same bits. Returns ``tensor``.
    """
    flat = _flat(tensor, "recursive_doubling_all_reduce", "tensor")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1 or flat.numel() == 0:
        return tensor
    power = 1 << (world.bit_length() - 1)
    extra = world - power
    incoming = scratch_buffers(flat.numel(), flat)[0]  # reused: no page faults per call
    if rank < 2 * extra:  # fold the surplus ranks into their odd neighbours
        if rank % 2 == 0:
            _send(flat, _global(group, rank + 1), group)
            _recv(flat, _global(group, rank + 1), group)
            return tensor
        _recv(incoming, _global(group, rank - 1), group)
        flat.add_(incoming)
    virtual = rank // 2 if rank < 2 * extra else rank - extra
    mask = 1
    while mask < power:
        partner_virtual = virtual ^ mask
        partner = partner_virtual * 2 + 1 if partner_virtual < extra else partner_virtual + extra
        exchange(flat, _global(group, partner), incoming, _global(group, partner), group)
        flat.add_(incoming)
        mask <<= 1
    if rank < 2 * extra:
        _send(flat, _global(group, rank - 1), group)
    return tensor


def predicted_bytes_sent(
    algorithm: str, numel: int, element_size: int, rank: int, world_size: int
) -> int:
    """Bytes rank ``rank`` sends in one all-reduce of ``numel`` elements (the formulas above)."""
    n, N = numel, world_size
    if N == 1 or n == 0:
        return 0
    if algorithm == "ring":
        sizes = chunk_sizes(n, N)
        elements = 2 * n - sizes[rank] - sizes[(rank + 1) % N]
    elif algorithm == "naive":
        elements = (N - 1) * n if rank == 0 else n
    elif algorithm == "recursive_doubling":
        power = 1 << (N.bit_length() - 1)
        extra = N - power
        steps = power.bit_length() - 1
        if rank < 2 * extra and rank % 2 == 0:
            elements = n
        else:
            elements = steps * n + (n if rank < 2 * extra else 0)
    else:
        raise ValueError(
            f"predicted_bytes_sent: unknown algorithm {algorithm!r}; "
            "use 'ring', 'naive' or 'recursive_doubling'"
        )
    return elements * element_size


ALGORITHMS = ("naive", "ring", "recursive_doubling")  # "auto" picks one of them (auto.py)


def all_reduce(tensor: torch.Tensor, algorithm: str = "ring",
               group: ProcessGroup | None = None, *,
               link: LinkCost | LinkCostCache | None = None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place with the named algorithm (one of ALGORITHMS, or
    "auto").

    Looked up by name at call time, so a learner's ring_all_reduce patched in by the
    grader is the one that runs. "auto": chapter 4's α–β model picks the algorithm for this
    tensor's bytes and the group's size (``auto.py``), with α and β from ``link`` (a
    ``LinkCost``, a ``LinkCostCache``, or None for this process's cache, which measures each
    group once); its ring is the pipelined one (``ring_all_reduce_pipelined``).
    """
    if algorithm not in ALGORITHMS and algorithm != "auto":
        raise ValueError(
            f"all_reduce: unknown algorithm {algorithm!r}; use one of {ALGORITHMS} or 'auto'"
        )
    if algorithm == "auto":
        flat = _flat(tensor, "all_reduce", "tensor")
        world = dist.get_world_size(group)
        if world == 1 or flat.numel() == 0:
            return tensor
        cost = resolve_link(link, group, flat.device)
        algorithm = choose_algorithm(flat.numel() * flat.element_size(), world, cost)
        if algorithm == "ring":
            return ring_all_reduce_pipelined(tensor, group)
    # this module's globals, read now: a ring_all_reduce the grader patched in is the one that runs
    run = {"naive": naive_all_reduce, "ring": ring_all_reduce,
           "recursive_doubling": recursive_doubling_all_reduce}[algorithm]  # fmt: skip
    return run(tensor, group)
