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
    """Sum ``input`` over all ranks and leave chunk r of the sum in ``output`` on rank r.

    ``input`` (n elements, not modified) is split into N chunks as by
    ``input.view(-1).tensor_split(N)``; ``output`` must have as many elements as this
    rank's chunk. N-1 steps: at step s rank r sends chunk (r-s-1) mod N — its own input
    chunk at s = 0, afterwards the partial sum it built at step s-1 — to its successor,
    receives the partial sum of chunk (r-s-2) mod N from its predecessor and adds its
    own input chunk to it. After the last step the chunk it completes is chunk r.
    Each rank sends n - |chunk r| elements. ``output`` may be a view of ``input``'s
    chunk r (ring_all_reduce relies on that). Returns ``output``.

    With one rank (N = 1) there are no steps and nothing is sent, but ``output`` must still
    receive the sum — the input itself, copied (DataParallel on one rank runs this path).

    May use: ``ring_neighbours(group)`` (predecessor, successor),
    ``exchange(send, to, recv, frm, group)`` (sends and receives at once, counting the
    bytes sent), ``scratch_buffers(n, like)`` (two scratch tensors of n elements),
    ``sizes`` (every chunk's length). Requirements and why: never write into ``input``
    (the caller still needs it, and ``output`` may alias chunk r of it), and send with
    ``exchange`` (sending and receiving together cannot deadlock, and the grader counts
    its bytes).
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
    # HINT: the partial sum you pass on cannot live in the input (it must stay unmodified) nor
    # HINT: in the buffer you are receiving into: one scratch buffer receives, another holds
    # HINT: the sum being sent; only the last step's sum goes into output
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

    ``output`` (n elements) is split as by ``output.view(-1).tensor_split(N)``; ``input``
    must have as many elements as chunk r. Rank r first copies its input into chunk r.
    N-1 steps: at step s rank r sends chunk (r-s) mod N to its successor and receives
    chunk (r-s-1) mod N from its predecessor, straight into ``output``. Each rank sends
    n - |chunk r+1| elements. ``input`` may be a view of ``output``'s chunk r.
    Returns ``output``.
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
    # HINT: after copying the input into chunk r, every step forwards the chunk received last
    chunks = flat_out.tensor_split(world)
    prev_rank, next_rank = ring_neighbours(group)
    chunks[rank].copy_(flat_in)
    for step in range(world - 1):
        send, recv = chunks[(rank - step) % world], chunks[(rank - step - 1) % world]
        exchange(send, next_rank, recv, prev_rank, group)
    return output
    ### END SOLUTION


def ring_all_reduce(tensor: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks, in place: a ring reduce-scatter, then a ring all-gather.

    Afterwards every rank holds the same sum, bit for bit (the all-gather copies the one
    sum each chunk's owner computed). Each rank sends 2n - |chunk r| - |chunk r+1|
    elements, i.e. 2(N-1)/N·n when N divides n. Returns ``tensor``.
    """
    flat = _flat(tensor, "ring_all_reduce", "tensor")
    ### BEGIN SOLUTION
    # HINT: what the reduce-scatter leaves on rank r is exactly what the all-gather needs from
    # HINT: rank r — and it may stay where it is, inside the tensor: no copy, no new buffer
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = flat.tensor_split(world)[rank]
    ring_reduce_scatter(mine, flat, group)
    ring_all_gather(flat, mine, group)
    return tensor
    ### END SOLUTION
