"""Chapter 4 solutions — generated from minitrain.collectives.ring, minitrain.ddp.bucketing, minitrain.ddp.data_parallel.

The worked answers. Look one up when you are stuck; the library has them too.
"""

from __future__ import annotations

import math
import torch
import torch.distributed as dist
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from torch import nn
from torch.distributed import ProcessGroup
from minitrain.collectives import LINK_COSTS
from minitrain.collectives.exchange import chunk_sizes, exchange, flat_view as _flat, scratch_buffers
from minitrain.ddp.gradient_bucket import GradientBucket, make_buckets
from minitrain.ddp.replicas import broadcast_from_first_rank, check_replicas_match
from minitrain.runtime import trace
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


def assign_buckets(params: list[torch.Tensor], bucket_cap_bytes: float) -> list[list[int]]:
    """Group parameters into buckets, each filled by gradients arriving one after another.

    ``params`` are in registration order (the order forward uses them); a bucket is one flat
    buffer whose all-reduce starts when its last gradient arrives in backward, so a bucket
    holds parameters whose gradients arrive together, in the order backward produces them.
    Returns a list of buckets, each a list of indices into ``params``: every index exactly
    once, each bucket's indices in the order their gradients arrive, the buckets in the
    order they fill. The rules (each graded):
    - a bucket closes once its bytes (``numel() * element_size()``) reach
      ``bucket_cap_bytes``, so it may overshoot by its last parameter, and a parameter
      larger than the cap joins the open bucket and closes it (cap 0: one bucket per
      parameter; ``math.inf``: one bucket);
    - a bucket holds one dtype and one device: a parameter whose dtype or device differs
      from the open bucket's closes that bucket first.
    """
    ### BEGIN SOLUTION
    buckets, current, current_bytes = [], [], 0
    for i in reversed(range(len(params))):
        p = params[i]
        if current and (p.dtype, p.device) != (params[current[0]].dtype, params[current[0]].device):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += p.numel() * p.element_size()
        if current_bytes >= bucket_cap_bytes:
            buckets.append(current)
            current, current_bytes = [], 0
    if current:
        buckets.append(current)
    return buckets
    ### END SOLUTION


class DataParallel:
    # Only the methods you write; the rest of the class is in minitrain.ddp.data_parallel.

    def _on_grad_ready(self, param):
        """Autograd calls this (via ``register_post_accumulate_grad_hook``, which passes the
        *parameter*) once ``param.grad`` holds this backward's gradient; returns nothing.

        What it must achieve: ``param``'s gradient, averaged over the ranks, reaches its slot
        of its bucket, and a bucket's all-reduce starts as soon as the bucket is full.

        May use: ``self._sync_enabled`` (False inside ``no_sync()``), ``self._start_sync()``
        (arranges the end-of-backward synchronisation; call it once a gradient will be
        synchronised), ``self._location[param]`` (its bucket and its index k there;
        ``bucket.view(k)`` is that slot of the flat buffer, same dtype as the gradient),
        ``self._ready`` (the set of parameters whose gradient is in place), ``bucket.ready``
        (how many of the bucket's parameters are in place), ``self.world_size``,
        ``self.overlap`` and ``self._launch_ready_buckets()`` (launches every full bucket, in
        bucket order).

        Requirements and why:
        - inside ``no_sync()`` nothing happens: gradient accumulation keeps the local sum and
          communicates once, at the last micro-batch (the point of ``no_sync``);
        - the all-reduce sums, so the average needs a division by the world size — done
          before the sum, as torch DDP does, so the buffer never holds W times a gradient
          (in fp16 that could overflow);
        - launch only through ``_launch_ready_buckets``, never a bucket directly: every rank
          must issue its all-reduces in the same (bucket) order, or collectives pair up wrong
          and deadlock; with ``overlap`` off nothing launches here (the end-of-backward
          callback launches everything);
        - a gradient put in place is counted in ``self._ready`` and ``bucket.ready``: the
          end-of-backward callback fills the slots of the parameters not in ``_ready`` (ones
          that got no gradient) and launches a bucket only once it is counted full.

        The grader trains on 2 and 4 ranks against one process on the whole batch, checks
        that an all-reduce starts before backward ends (overlap on) and none during backward
        with overlap off, and that a backward inside ``no_sync()`` launches nothing.
        """
        ### BEGIN SOLUTION
        if not self._sync_enabled:
            return
        self._start_sync()
        if param.grad.is_sparse:
            raise ValueError(
                "DataParallel: sparse gradients are not supported "
                f"(parameter of shape {tuple(param.shape)})"
            )
        bucket, k = self._location[param]
        torch.div(param.grad.reshape(-1), self.world_size, out=bucket.view(k))
        self._ready.add(param)
        bucket.ready += 1
        if self.overlap:
            self._launch_ready_buckets()
        ### END SOLUTION

# minitrain-exercises-hash: a3d56a76d33e5611
