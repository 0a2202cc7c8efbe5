"""The ring all-reduce at the speed of gloo's: the same ring as ``ring.py``, streamed in segments.

Used by notebooks/04_collectives_and_data_parallel.ipynb (next to the readable exercise
``ring_all_reduce``), by ``all_reduce(..., "auto")`` (``auto.py``) whenever the α–β model
picks the ring, and by ``python -m minitrain.bench allreduce``.

What the readable ring wastes (measured in issue 33's profile, 64 MiB, 2 loaded cores): each
of its 2(N-1) steps waits for the whole chunk to arrive, *then* adds it (a separate pass over
memory, 13 % of the time), *then* sends it on — the link idles while the core adds and the
core idles while the link carries. Here every chunk is cut into segments and each segment
moves on as soon as it is ready:

* all the receives of a step are posted at once (into one of two alternating scratch
  buffers, so the next step's receives are already posted while this step is being added);
* a segment is added *in place* into the tensor (``flat[c] += received``: the tensor itself
  is the accumulator, no extra copy) and sent on at once — its send overlaps the add of the
  next segment and the arrival of the ones after it;
* the chunk completed last is sent on segment by segment, and the all-gather receives
  straight into the tensor and forwards each segment the moment it lands.

Same algorithm, same bytes (2(N-1)/N·n per rank), same chunk layout and the same bits as
``ring_all_reduce`` (the reduce-scatter adds in the same order, (received) + own, and the
all-gather copies one owner's sum), so the tests compare the two exactly. Each message
carries its own tag (step and segment), so several receives from the same neighbour can be
posted at once without depending on the order a back-end matches them in.
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
TAG_BASE = 1 << 20  # away from tag 0, which minitrain's other point-to-point code uses


def _segments(chunk: torch.Tensor, count: int) -> tuple[torch.Tensor, ...]:
    return chunk.tensor_split(count) if chunk.numel() else ()


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
    sends: dict[int, list] = {}  # chunk → its sends still in flight (wait before overwriting)

    def send(chunk: int, seg: torch.Tensor, tag: int) -> None:
        if seg.numel():
            sends.setdefault(chunk, []).append(dist.isend(seg, next_rank, group=group, tag=tag))
            record_send(seg)

    def post_receives(step: int, into: torch.Tensor, chunk: int) -> list:
        for work in sends.pop(chunk, []):  # the all-gather receives over what we sent before
            work.wait()
        return [
            dist.irecv(seg, prev_rank, group=group, tag=TAG_BASE + step * MAX_SEGMENTS + j)
            if seg.numel() else None
            for j, seg in enumerate(_segments(into, count))
        ]

    # reduce-scatter: step s receives chunk (r-s-2) mod N, adds it in place and sends it on
    first = (rank - 1) % world
    for j, seg in enumerate(_segments(chunks[first], count)):
        send(first, seg, TAG_BASE + j)
    c = (rank - 2) % world
    pending = post_receives(0, scratch[0][: sizes[c]], -1)
    for step in range(world - 1):
        c = (rank - step - 2) % world
        received = _segments(scratch[step % 2][: sizes[c]], count)
        if step + 1 < world - 1:  # post the next step's receives before adding this one
            nxt = (rank - step - 3) % world
            following = post_receives(step + 1, scratch[(step + 1) % 2][: sizes[nxt]], -1)
        else:  # the all-gather's first receives, straight into the tensor
            nxt = (rank - 1) % world
            following = post_receives(world - 1, chunks[nxt], nxt)
        for j, (work, own, got) in enumerate(zip(pending, _segments(chunks[c], count), received)):
            if work is None:
                continue
            work.wait()
            # own + received in place: what ring_reduce_scatter computes (IEEE addition is
            # commutative, so the same bits), with no scratch accumulator to copy from
            torch.add(own, got, out=own)
            send(c, own, TAG_BASE + (step + 1) * MAX_SEGMENTS + j)
        pending = following
    # all-gather: step s receives chunk (r-s-1) mod N into the tensor and forwards it
    for step in range(world - 1):
        c = (rank - step - 1) % world
        last = step == world - 2
        if not last:
            nxt = (rank - step - 2) % world
            following = post_receives(world + step, chunks[nxt], nxt)
        for j, (work, seg) in enumerate(zip(pending, _segments(chunks[c], count))):
            if work is None:
                continue
            work.wait()
            if not last:
                send(c, seg, TAG_BASE + (world + step) * MAX_SEGMENTS + j)
        if not last:
            pending = following
    for works in sends.values():
        for work in works:
            work.wait()
    return tensor
