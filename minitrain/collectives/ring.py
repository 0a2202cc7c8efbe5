"""Ring reduce-scatter, all-gather and all-reduce from send and receive: chapter 4's exercises.

Used by notebooks/04_collectives_and_data_parallel.ipynb (through ``minitrain.collectives``,
which re-exports them) and by ``minitrain.ddp``'s ``communication="ring"``; listed in
``minitrain/course/chapters.py`` CHAPTERS, so ``python -m minitrain.exercises build`` makes
the chapter 4 exercise stubs from these functions and the grader patches a learner's version
in here (every ``minitrain`` module holding them, ``minitrain.collectives`` included, gets it).

The algorithm (Patarasuk & Yuan 2009; Baidu's "ring all-reduce" 2017), its byte counts and
the chunk layout (``flat.tensor_split(N)``, rank r owns chunk r) are explained in
the package's docstring (``minitrain/collectives/__init__.py``), next to the naive and
recursive-doubling ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from minitrain.collectives.exchange import chunk_sizes, exchange, scratch_buffers

# flat_view under the name the exercises were written with (their text, the generated stubs
# and notebook 04's printout say ``_flat``)
from minitrain.collectives.exchange import flat_view as _flat
from minitrain.runtime.point_to_point import ring_neighbours


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor,
                        group: ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``input`` over the ranks of ``group``; leave chunk r of the sum in ``output`` on rank r.

    Chunks are as by ``input.view(-1).tensor_split(N)`` (N ranks; some chunks are empty
    when n < N, and n may be 0); ``output`` (checked above) has as many elements as this
    rank's chunk, and the same dtype; the sum is computed in that dtype. ``group`` (None:
    every rank): the ranks taking part, numbered within the group. Returns ``output``.

    Requirements and why:
    - never write into ``input``: the caller still needs it, and ``output`` may be a view of
      ``input``'s chunk r (``ring_all_reduce`` relies on that);
    - send only with ``exchange``: a ring of sends and receives issued together cannot
      deadlock, and the grader counts its bytes — each rank sends exactly
      n - |chunk r| elements, no more;
    - with one rank nothing is sent, but ``output`` still receives the sum: the input
      itself, copied (DataParallel on one rank runs this path).

    May use (above, or imported): ``flat_in`` / ``flat_out`` (1-d views), ``rank``,
    ``world``, ``sizes`` (every chunk's length), ``ring_neighbours(group)`` (predecessor,
    successor, as global ranks), ``exchange(send, to, recv, frm, group)`` (sends one tensor
    while receiving another; empty tensors are skipped on both ends), and
    ``scratch_buffers(n, like)`` (two scratch tensors of n elements, reused from call to
    call: a fresh buffer per call costs page faults).
    """
    name = "ring_reduce_scatter"
    flat_in, flat_out = _flat(input, name, "input"), _flat(output, name, "output")
    if output.dtype != input.dtype:
        raise ValueError(f"{name}: output dtype {output.dtype} differs from input {input.dtype}")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    sizes = chunk_sizes(flat_in.numel(), world)
    if flat_out.numel() != sizes[rank]:
        raise ValueError(
            f"{name}: output has {flat_out.numel()} elements, but rank {rank}'s chunk of an "
            f"input of {flat_in.numel()} elements over {world} ranks has {sizes[rank]}"
        )
    ### BEGIN SOLUTION
    chunks = flat_in.tensor_split(world)
    prev_rank, next_rank = ring_neighbours(group)
    if world == 1:
        flat_out.copy_(flat_in)
        return output
    recv_buf, acc_buf = scratch_buffers(max(sizes), input)
    send = chunks[(rank - 1) % world]
    for step in range(world - 1):
        c = (rank - step - 2) % world  # the chunk whose partial sum arrives now
        recv = recv_buf[: sizes[c]]
        exchange(send, next_rank, recv, prev_rank, group)
        last = step == world - 2
        acc = flat_out if last else acc_buf[: sizes[c]]
        torch.add(chunks[c], recv, out=acc)  # own contribution + everyone's before us
        send = acc
    return output
    ### END SOLUTION


def ring_all_gather(output: torch.Tensor, input: torch.Tensor,
                    group: ProcessGroup | None = None) -> torch.Tensor:
    """Fill ``output`` on every rank with every rank's ``input``, rank r's input as chunk r.

    Chunks are as by ``output.view(-1).tensor_split(N)`` (some may be empty when n < N);
    ``input`` (checked above) has as many elements as this rank's chunk, and the same dtype.
    ``group`` (None: every rank): the ranks taking part. Returns ``output``; ``input`` is
    not modified, and it may be a view of ``output``'s chunk r.

    Requirements and why: send only with ``exchange`` (cannot deadlock, and the grader
    counts its bytes): each rank sends exactly n - |chunk (r+1) mod N| elements — nothing
    twice, and no extra buffer or copy: every message can land where it belongs. With one
    rank nothing is sent. May use what ``ring_reduce_scatter`` may.
    """
    name = "ring_all_gather"
    flat_in, flat_out = _flat(input, name, "input"), _flat(output, name, "output")
    if output.dtype != input.dtype:
        raise ValueError(f"{name}: output dtype {output.dtype} differs from input {input.dtype}")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    sizes = chunk_sizes(flat_out.numel(), world)
    if flat_in.numel() != sizes[rank]:
        raise ValueError(
            f"{name}: input has {flat_in.numel()} elements, but rank {rank}'s chunk of an "
            f"output of {flat_out.numel()} elements over {world} ranks has {sizes[rank]}"
        )
    ### BEGIN SOLUTION
    chunks = flat_out.tensor_split(world)
    prev_rank, next_rank = ring_neighbours(group)
    chunks[rank].copy_(flat_in)
    for step in range(world - 1):
        send, recv = chunks[(rank - step) % world], chunks[(rank - step - 1) % world]
        exchange(send, next_rank, recv, prev_rank, group)
    return output
    ### END SOLUTION


def ring_all_reduce(tensor: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks of ``group``, in place, with this chapter's ring collectives.

    Afterwards every rank holds the same sum, bit for bit (the grader compares the ranks),
    in ``tensor`` itself, which is returned. Each rank sends exactly
    2n - |chunk r| - |chunk (r+1) mod N| elements (chunks as by ``tensor_split(N)``), i.e.
    2(N-1)/N·n when N divides n — the ring all-reduce's cost, which the grader counts; no
    new buffer or copy of the tensor is needed. May use ``ring_reduce_scatter`` and
    ``ring_all_gather`` (graded with the library's versions of them) and ``flat`` (above).
    """
    flat = _flat(tensor, "ring_all_reduce", "tensor")
    ### BEGIN SOLUTION
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = flat.tensor_split(world)[rank]
    ring_reduce_scatter(mine, flat, group)
    ring_all_gather(flat, mine, group)
    return tensor
    ### END SOLUTION
