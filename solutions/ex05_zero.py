"""Chapter 5 solutions — generated from minitrain.zero.partition, minitrain.zero.optimizer, minitrain.zero.data_parallel, minitrain.fsdp.wrapper.

The worked answers. Look one up when you are stuck; the library has them too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from minitrain.ddp import assign_buckets, broadcast_from_first_rank
from minitrain.fsdp.clipping import clip_grad_norm_
from minitrain.fsdp.gathers import UnitGathers
from minitrain.fsdp.shards import register_shards, replicated_ids
from minitrain.runtime import trace
from minitrain.zero.accounting import count_sent, optimizer_state_tensors, storage_bytes
from minitrain.zero.buffers import FlatUnit, all_gather_tensor, reduce_scatter_tensor, timed
from minitrain.zero.gather_order import OrderedGathers
from minitrain.zero.mixed_precision import attach_master, cast_inputs, cast_rest
from minitrain.zero.sharded_units import split_into_units, tensors_requiring_grad
from minitrain.zero.step_transfers import hand_gradients_to_masters, point_gradients_at_buffer, reduce_scatter_gradients, write_back_shards


def partition_parameters(sizes: list[int], world_size: int) -> list[list[int]]:
    """Assign parameters (by index) to ranks so every rank owns about the same number of elements.

    Greedy "largest first" (Graham 1969, LPT): visit the sizes from largest to smallest (ties:
    lower index first) and give each to the rank with the fewest elements so far (ties: lower
    rank). Returns, per rank, its indices in increasing order. Every rank must get the same
    answer, so the rule is deterministic. E.g. sizes [4, 3, 3, 2, 2] on 2 ranks → [[0, 3, 4], [1, 2]]
    (8 and 6 elements; the best split is 7 and 7: greedy's largest load is within 4/3 of the best).
    """
    ### BEGIN SOLUTION
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    loads, owned = [0] * world_size, [[] for _ in range(world_size)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world_size), key=lambda r: (loads[r], r))
        owned[r].append(i)
        loads[r] += sizes[i]
    return [sorted(o) for o in owned]
    ### END SOLUTION


class ShardedOptimizer:
    # Only the methods you write; the rest of the class is in minitrain.zero.optimizer.

    def step(self, closure=None):
        """The ZeRO-1 step: update this rank's share, then let every rank see all updates.

        Returns ``closure()``'s loss if a closure is given (run it first, with grad enabled),
        else None. May use: ``self.param_groups`` (what the caller and a scheduler see and
        change), ``self.optimizer`` (the local optimizer over this rank's parameters only; its
        own ``param_groups``, in the same order), ``self.owned[r]`` (indices, into the flat
        list of all parameters of ``self.param_groups``, of the parameters rank r updates),
        ``self.rank``, ``self.world_size``, ``self.group``, ``all_gather_tensor(output,
        input, group=...)`` (every rank's equal-sized input, concatenated in rank order) and
        ``count_sent("all_gather", buffer_bytes, N)`` (counts a collective on a buffer).

        Requirements and why:
        - the local optimizer must step with the hyperparameters the caller sees: a scheduler
          changes ``self.param_groups`` ("lr", but also "weight_decay", ...) — copy every key
          but "params" before stepping;
        - after the step every rank holds every updated parameter: one all-gather, all ranks
          sending the same number of elements (so the shares are padded to the largest);
        - count the bytes with the *full* buffer (the all-gather's output), as ``count_sent``
          expects, so the log matches chapter 4's (N-1)/N formula.
        """
        ### BEGIN SOLUTION
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for mine, local in zip(self.param_groups, self.optimizer.param_groups):
            local.update({k: v for k, v in mine.items() if k != "params"})
        self.optimizer.step()
        every = [p for g in self.param_groups for p in g["params"]]
        width = max(sum(every[i].numel() for i in o) for o in self.owned)
        if width == 0:
            return loss
        with torch.no_grad():
            ref = every[0]
            packed = torch.zeros(width, dtype=ref.dtype, device=ref.device)
            flat = [every[i].reshape(-1) for i in self.owned[self.rank]]
            if flat:
                torch.cat(flat, out=packed[: sum(f.numel() for f in flat)])
            gathered = torch.empty(width * self.world_size, dtype=ref.dtype, device=ref.device)
            all_gather_tensor(gathered, packed, group=self.group)
            count_sent("all_gather", gathered.numel() * gathered.element_size(), self.world_size)
            for r, owned in enumerate(self.owned):
                offset = r * width
                for i in owned:
                    n = every[i].numel()
                    every[i].copy_(gathered[offset : offset + n].view_as(every[i]))
                    offset += n
        return loss
        ### END SOLUTION


class ZeroDataParallel:
    # Only the methods you write; the rest of the class is in minitrain.zero.data_parallel.

    def _pre_forward(self, index):
        """Stage 3, before block ``index``'s forward: make its parameters whole, prefetch the next.

        ``index``: the block about to run (0 .. len(self.blocks) - 1); returns nothing.
        May use: ``self.units[i]`` (block i's unit of sharded parameters),
        ``self._start_gather(unit)`` (launches its asynchronous all-gather; does nothing if one
        is in flight or done), ``self._wait_gather(unit)`` (starts it if needed, blocks until
        the parameters are whole), ``self.blocks``, ``trace.now(self.device)`` (this moment on
        the device's clock: a GPU's event); set ``self._block_start`` to when the block's
        compute starts (``_post_forward`` records the span from it).

        Requirements and why: block ``index`` cannot compute before its own parameters are
        whole; block ``index + 1``'s gather must be *in flight* — started, not waited for —
        while block ``index`` computes, so the transfer hides behind the compute (Rajbhandari
        et al. 2020, section 7.2.2: prefetching); waiting for it here would serialise them again.
        """
        ### BEGIN SOLUTION
        self._wait_gather(self.units[index])
        if index + 1 < len(self.blocks):
            self._start_gather(self.units[index + 1])
        self._block_start = trace.now(self.device)
        ### END SOLUTION

    def _post_forward(self, index, output):
        """Stage 3, after block ``index``'s forward: free its parameters, arrange the re-gather.

        ``output``: what the block returned (a tensor here). Returns nothing.
        May use: ``trace.record(name, "compute", start, end)`` (record the block's compute as
        ``f"forward block {index}"`` from ``self._block_start`` to ``trace.now(self.device)``),
        ``self._free(unit)``, ``self.units[index]``, ``self._pre_backward(index)`` (gathers the
        unit again), ``torch.is_grad_enabled()``.

        Requirements and why: free the unit at once — holding every block's full parameters
        is exactly the memory ZeRO-3 saves; backward will need them again just before the
        block's own backward runs, which is when backward reaches the block's *output*: arrange
        for ``self._pre_backward(index)`` to run then (only when there will be a backward:
        grad enabled and an output that requires grad).
        """
        ### BEGIN SOLUTION
        trace.record(f"forward block {index}", "compute", self._block_start, trace.now(self.device))
        self._free(self.units[index])
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: self._pre_backward(index))
        ### END SOLUTION


class FullyShardedDataParallel:
    # Only the methods you write; the rest of the class is in minitrain.fsdp.wrapper.

    def _pre_forward(self, index):
        """Before unit ``index``'s forward (Zhao et al. 2023): its parameters whole.

        Returns nothing. May use: ``self._gather_in_order(i)`` (launches, in unit order, every
        gather not yet launched up to unit i — never out of order, so all ranks issue the same
        collectives), ``self._wait_gather(unit)``, ``self._free(unit)`` (both accept None),
        ``self.units``, ``trace.now(self.device)`` (this moment on the device's clock: a GPU's
        event); set ``self._unit_start`` when the unit's compute starts.

        Requirements and why: this unit's parameters whole before it computes; the *next*
        unit's gather launched too, so it travels while this one computes (forward
        prefetching); every earlier unit freed — a branch not taken may have skipped a unit
        whose prefetched gather is still held, and only this hook can return that memory.
        """
        ### BEGIN SOLUTION
        self._gather_in_order(index + 1)
        for earlier in self.units[:index]:
            self._free(earlier)
        self._wait_gather(self.units[index])
        self._unit_start = trace.now(self.device)
        ### END SOLUTION

    def _post_forward(self, index, output):
        """After unit ``index``'s forward: record it, free it, and arrange its re-gather.

        ``output``: what the unit returned — a tensor, or a tuple/list/dict of them (a block
        may return ``(hidden, extra)``). Returns nothing. May use: ``trace.record(f"forward
        block {index}", "compute", self._unit_start, trace.now(self.device))``,
        ``self._free(unit)``, ``self._pre_backward(index)`` (gathers the unit again),
        ``tensors_requiring_grad(output)`` (every tensor in it that requires grad),
        ``torch.is_grad_enabled()``.

        Requirements and why: free the unit now (that is FSDP's memory saving); backward
        reaches the unit through *any* of its outputs, so each one that requires grad must
        trigger ``_pre_backward(index)`` — hooking only a single tensor misses tuples, and
        backward then runs on freed parameters.
        """
        ### BEGIN SOLUTION
        trace.record(f"forward block {index}", "compute", self._unit_start, trace.now(self.device))
        self._free(self.units[index])
        for t in tensors_requiring_grad(output) if torch.is_grad_enabled() else []:
            t.register_hook(lambda grad: self._pre_backward(index))
        ### END SOLUTION

    def _launch_reduce_scatter(self, u):
        """Start the averaging of unit ``u``'s complete fp32 gradient ``u.grad_full``.

        ``u.grad_full``: the flat gradient of the whole unit (``u.padded`` elements, fp32);
        returns nothing. What each rank must end up with: a sharded unit, the sum over ranks
        of *its* slice only (``u.shard_numel`` elements, in a new tensor); the replicated unit
        (``u.keep_full``: parameters every rank keeps whole), the sum of the whole gradient
        (in place). May use: ``reduce_scatter_tensor(out, input, group=..., async_op=True)``,
        ``dist.all_reduce(tensor, group=..., async_op=True)`` (both return a work handle),
        ``timed(work)``, ``count_sent(kind, buffer_bytes, N)`` (kind "reduce_scatter" or
        "all_reduce", the full buffer's bytes), ``trace.now(self.device)``, ``self.group``,
        ``self.world_size``.

        Requirements and why: launch asynchronously and do not wait — the reduction overlaps
        the rest of backward; hand the result over by appending ``(u, out, timed(work),
        start time)`` to ``self._pending`` (the end of backward waits for each, divides by N
        and stores it); count bytes, not elements (the log compares with bandwidth).
        """
        ### BEGIN SOLUTION
        start, buf = trace.now(self.device), u.grad_full
        if u.keep_full:
            out, kind = buf, "all_reduce"
            work = dist.all_reduce(out, group=self.group, async_op=True)
        else:
            out, kind = torch.empty(u.shard_numel, dtype=buf.dtype, device=buf.device), "reduce_scatter"
            work = reduce_scatter_tensor(out, buf, group=self.group, async_op=True)
        count_sent(kind, u.padded * buf.element_size(), self.world_size)
        self._pending.append((u, out, timed(work), start))
        ### END SOLUTION

# minitrain-exercises-hash: 02100d80ba6e69bb
