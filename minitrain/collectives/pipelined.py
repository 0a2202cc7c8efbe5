"""The ring all-reduce at the speed of gloo's: the same ring as ``ring.py``, streamed in segments.

Used by notebooks/04_collectives_and_data_parallel.ipynb (next to the readable exercise
``ring_all_reduce``), by ``all_reduce(..., "auto")`` (``auto.py``) whenever the α–β model
picks the ring, and by ``python -m minitrain.bench allreduce``.

What the readable ring wastes (measured in issue 33's profile, 64 MiB, 2 loaded cores): each
of its 2(N-1) steps waits for the whole chunk to arrive, *then* adds it (a separate pass over
memory, 13 % of the time), *then* sends it on — the link idles while the core adds and the
core idles while the link carries. Here every chunk is cut into segments and each segment
moves on as soon as it is ready:

* the 2(N-1) steps are one sequence t = 0 … 2N-3: at step t a rank sends segment j of one
  chunk to its successor and receives segment j of another from its predecessor, *as one
  group* (``batch_isend_irecv``: NCCL's "Group calls", Megatron-LM's paired
  ``send_forward_recv_backward``), so no receive ever blocks the send its peer waits for;
* what a step sends is what the step before received: a received segment is added *in
  place* into the tensor (``flat[c] += received``: the tensor itself is the accumulator, no
  extra copy) during the reduce-scatter, or lands straight in the tensor during the
  all-gather, and goes out at once in the next step's group — while the segments behind it
  are still travelling, so adding, sending and receiving overlap;
* receives alternate between two scratch buffers, so a segment arriving for step t never
  overwrites one of step t-1 not yet added.

The price of pairing (issue 41): a receive can no longer be posted a step ahead, as the
version before did — on NCCL that receive would block the rank's stream ahead of the send its
peer waits for. gloo moves a message only once its receive is posted, so neighbours now move
more in step: ~5-8 % slower at 64 MiB on 2 loaded cores than the pre-posted version (median of
interleaved repetitions), still within 1.15× gloo's own all-reduce.

Same algorithm, same bytes (2(N-1)/N·n per rank), same chunk layout and the same bits as
``ring_all_reduce`` (the reduce-scatter adds in the same order, (received) + own, and the
all-gather copies one owner's sum), so the tests compare the two exactly. No tags: every rank
issues the same sequence of groups, so a pair's messages match in issue order, the only
matching NCCL knows (it ignores tags).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from minitrain.collectives.exchange import chunk_sizes, flat_view, record_send, scratch_buffers
from minitrain.runtime.point_to_point import ring_neighbours

# Segments of at least this many bytes: below it the per-message latency α (~50-100 µs here)
# costs more than the overlap saves; 4 MiB ~ 1-2 ms of adding, enough to hide a send behind.
SEGMENT_BYTES = 4 * 1024 * 1024
MAX_SEGMENTS = 8  # per chunk: more in-flight messages bring nothing measurable here


def _segments(chunk: torch.Tensor, count: int) -> tuple[torch.Tensor, ...]:
    return chunk.tensor_split(count)  # empty segments too: both ends skip the same messages


def segment_count(chunk_numel: int, element_size: int,
                  segment_bytes: int = SEGMENT_BYTES) -> int:
    """How many segments a chunk of ``chunk_numel`` elements is streamed in (≥ 1)."""
    return max(1, min(MAX_SEGMENTS, chunk_numel * element_size // max(1, segment_bytes)))


def ring_all_reduce_pipelined(tensor: torch.Tensor, group: ProcessGroup | None = None,
                              segment_bytes: int = SEGMENT_BYTES) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place: ``ring_all_reduce`` with each chunk streamed in
    segments so sending, receiving and adding overlap (module docstring). Bitwise the same
    result as ``ring_all_reduce``. Returns ``tensor``.

    Patarasuk & Yuan 2009 (the ring), pipelined by segments as in their §4 and as NCCL's
    ring kernels do ("slices" of a chunk in flight).
    """
    flat = flat_view(tensor, "ring_all_reduce_pipelined", "tensor")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1 or flat.numel() == 0:
        return tensor
    prev_rank, next_rank = ring_neighbours(group)
    sizes = chunk_sizes(flat.numel(), world)
    count = segment_count(sizes[0], flat.element_size(), segment_bytes)
    chunks = flat.tensor_split(world)
    scratch = scratch_buffers(sizes[0], flat)
    steps = 2 * (world - 1)
    # step t sends chunk (r-t-1) mod N, receives chunk (r-t-2) mod N: the reduce-scatter's
    # steps (t < N-1) into a scratch buffer, the all-gather's straight into the tensor
    sent = lambda t: (rank - t - 1) % world  # noqa: E731
    received = lambda t: (rank - t - 2) % world  # noqa: E731

    def into(t: int) -> torch.Tensor:
        c = received(t)
        return scratch[t % 2][: sizes[c]] if t < world - 1 else chunks[c]

    sends: dict = {}  # (chunk, segment) → its send in flight (wait before receiving over it)
    receives: list = [None] * count  # segment j → the receive of the step being worked on

    def step(t: int, j: int, out: torch.Tensor) -> None:
        """Step t's group for segment j: send ``out`` on, receive segment j of step t."""
        if t >= world - 1:  # the all-gather receives over a segment sent N-1 steps ago
            earlier = sends.pop((received(t), j), None)
            if earlier is not None:
                earlier.wait()
        recv = _segments(into(t), count)[j]
        ops = [dist.P2POp(dist.irecv, recv, prev_rank, group)] if recv.numel() else []
        if out.numel():
            ops.append(dist.P2POp(dist.isend, out, next_rank, group))
            record_send(out)
        works = dist.batch_isend_irecv(ops) if ops else []
        receives[j] = works[0] if recv.numel() else None
        if out.numel():
            sends[sent(t), j] = works[-1]

    for j, seg in enumerate(_segments(chunks[sent(0)], count)):
        step(0, j, seg)
    for t in range(1, steps + 1):  # wait for step t-1's segments; pass each on in step t
        pairs = zip(_segments(chunks[received(t - 1)], count), _segments(into(t - 1), count))
        for j, (own, got) in enumerate(pairs):
            if receives[j] is not None:
                receives[j].wait()
            if t - 1 < world - 1:
                # reduce-scatter: own + received in place, what ring_reduce_scatter computes
                # (IEEE addition is commutative, so the same bits), no accumulator to copy from;
                # the all-gather received straight into the tensor: forwarded as it is
                torch.add(own, got, out=own)
            if t < steps:
                step(t, j, own)
    for work in sends.values():
        work.wait()
    return tensor
