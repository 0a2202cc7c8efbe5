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


def assign_buckets(params: list[torch.Tensor], bucket_cap_bytes: float) -> list[list[int]]:
    """Group parameters into buckets in the order their gradients become ready.

    ``params`` are in registration order; backward produces gradients roughly in
    *reverse* order, so walk them from last to first. Add each parameter to the open
    bucket; close the bucket once it holds ≥ ``bucket_cap_bytes`` bytes (so a bucket may
    overshoot by its last parameter: one larger than the cap closes the bucket it joins). A bucket is one flat buffer, so a parameter whose dtype or device differs
    from the open bucket's closes that bucket first. Returns lists of indices into
    ``params``: e.g. sizes [4, 4, 4] bytes with a cap of 8 give [[2, 1], [0]].
    """
    ### BEGIN SOLUTION
    # HINT: walk the parameters in the order their gradients arrive in backward, which is not
    # HINT: the order they are listed in; count bytes, not elements
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
          callback launches everything).
        """
        ### BEGIN SOLUTION
        # HINT: check the no_sync case first; each other call is one slot filled and one
        # HINT: more parameter counted ready in its bucket
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

# minitrain-exercises-hash: 2a0e6513fe0b0a16
