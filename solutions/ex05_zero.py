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
from minitrain.runtime import trace
from minitrain.zero.accounting import count_sent, optimizer_state_tensors, storage_bytes
from minitrain.zero.buffers import FlatUnit, all_gather_tensor, reduce_scatter_tensor, timed
from minitrain.zero.gather_order import OrderedGathers
from minitrain.zero.mixed_precision import attach_master, cast_inputs, cast_rest, host_buffer, wait_for_host_copies
from minitrain.zero.sharded_units import ShardedUnits, split_into_units, tensors_requiring_grad


def partition_parameters(sizes: list[int], world_size: int) -> list[list[int]]:
    """Assign parameters (by index) to ranks so every rank owns about the same number of elements.

    Greedy "largest first" (Graham 1969, LPT): visit the sizes from largest to smallest (ties:
    lower index first) and give each to the rank with the fewest elements so far (ties: lower
    rank). Returns, per rank, its indices in increasing order. Every rank must get the same
    answer, so the rule is deterministic. E.g. sizes [4, 3, 3, 2, 2] on 2 ranks → [[0, 3, 4], [1, 2]]
    (8 and 6 elements; the best split is 7 and 7: greedy's largest load is within 4/3 of the best).
    """
    ### BEGIN SOLUTION
    # HINT: loads = [0] * world_size; min(range(world_size), key=lambda r: (loads[r], r))
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

        1. copy the hyperparameters of ``self.param_groups`` (a scheduler may have changed
           "lr") into ``self.optimizer.param_groups`` (same order), except "params";
        2. ``self.optimizer.step()``: this rank's parameters only;
        3. share: every rank packs its owned parameters (``self.owned[self.rank]``, indices
           into the flat list of all parameters) into a buffer padded to the largest share,
           one all-gather (``all_gather_tensor``) of the N buffers, then every rank copies each
           owner's values into its parameters. Count it: ``count_sent("all_gather", bytes, N)``.
        Runs ``closure`` (with grad enabled) first if given and returns its loss.
        """
        ### BEGIN SOLUTION
        # HINT: sizes = [[every[i].numel() for i in o] for o in self.owned]; width = max(map(sum, sizes))
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

        Wait for unit ``self.units[index]`` (``self._wait_gather``: it starts the gather if
        the prefetch did not), then start (don't wait for) the gather of block ``index + 1``,
        if there is one, so it overlaps this block's compute. Record when the block's compute
        starts: ``self._block_start = trace.now()``.
        """
        ### BEGIN SOLUTION
        # HINT: self._start_gather(unit) launches an asynchronous all-gather
        self._wait_gather(self.units[index])
        if index + 1 < len(self.blocks):
            self._start_gather(self.units[index + 1])
        self._block_start = trace.now()
        ### END SOLUTION

    def _post_forward(self, index, output):
        """Stage 3, after block ``index``'s forward: free its parameters, arrange the re-gather.

        Record the block's compute (``trace.record(f"forward block {index}", "compute",
        self._block_start, trace.now())``), free unit ``self.units[index]`` (``self._free``),
        and, if grad is enabled and ``output`` requires grad, register a hook on ``output``
        that calls ``self._pre_backward(index)``: backward reaches a block's output just before
        it runs the block's own backward, which needs the parameters again.
        """
        ### BEGIN SOLUTION
        # HINT: output.register_hook(fn) calls fn(grad) when the gradient of output is known
        trace.record(f"forward block {index}", "compute", self._block_start, trace.now())
        self._free(self.units[index])
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: self._pre_backward(index))
        ### END SOLUTION


class FullyShardedDataParallel:
    # Only the methods you write; the rest of the class is in minitrain.fsdp.wrapper.

    def _pre_forward(self, index):
        """Before unit ``index``'s forward (Zhao et al. 2023): its parameters whole.

        Launch, in unit order, the gathers up to the *next* unit (``self._gather_in_order(
        index + 1)``: this unit's, if no prefetch did, and the next one's, so it travels while
        this unit computes: forward prefetching); free the earlier units (``self._free``: a branch may have
        skipped one, then its prefetched gather is still held); wait for this unit's gather
        (``self._wait_gather``); note the start: ``self._unit_start = trace.now()``.
        """
        ### BEGIN SOLUTION
        # HINT: self.units[:index] are the earlier units; _free and _wait_gather accept None
        self._gather_in_order(index + 1)
        for earlier in self.units[:index]:
            self._free(earlier)
        self._wait_gather(self.units[index])
        self._unit_start = trace.now()
        ### END SOLUTION

    def _post_forward(self, index, output):
        """After unit ``index``'s forward: record it, free it, and arrange its re-gather.

        ``trace.record(f"forward block {index}", "compute", self._unit_start, trace.now())``,
        free ``self.units[index]`` (``self._free``), and if grad is enabled, register on every
        tensor of ``output`` that requires grad (``tensors_requiring_grad(output)``: the
        output may be a tuple) a hook calling ``self._pre_backward(index)``, which gathers the
        unit again just before its backward runs.
        """
        ### BEGIN SOLUTION
        # HINT: tensor.register_hook(fn) calls fn(grad) when backward reaches that tensor
        trace.record(f"forward block {index}", "compute", self._unit_start, trace.now())
        self._free(self.units[index])
        for t in tensors_requiring_grad(output) if torch.is_grad_enabled() else []:
            t.register_hook(lambda grad: self._pre_backward(index))
        ### END SOLUTION

    def _launch_reduce_scatter(self, u):
        """Start the averaging of unit ``u``'s complete fp32 gradient ``u.grad_full``.

        A sharded unit: reduce-scatter it into a new tensor of ``u.shard_numel`` elements
        (``reduce_scatter_tensor(out, u.grad_full, group=self.group, async_op=True)``): rank
        r receives the sum of slice r. The replicated unit (``u.keep_full``): all-reduce
        ``u.grad_full`` in place (``out`` is then ``u.grad_full`` itself). Count the bytes
        (``count_sent(kind, u.padded * 4, self.world_size)``: 4 bytes, fp32; "reduce_scatter" or
        "all_reduce"), and append ``(u, out, timed(work), start time)`` to ``self._pending``;
        the end of backward waits for them and divides by N.
        """
        ### BEGIN SOLUTION
        # HINT: dist.all_reduce(tensor, group=..., async_op=True) returns a work handle too
        start, buf = trace.now(), u.grad_full
        if u.keep_full:
            out, kind = buf, "all_reduce"
            work = dist.all_reduce(out, group=self.group, async_op=True)
        else:
            out, kind = torch.empty(u.shard_numel, dtype=buf.dtype, device=buf.device), "reduce_scatter"
            work = reduce_scatter_tensor(out, buf, group=self.group, async_op=True)
        count_sent(kind, u.padded * buf.element_size(), self.world_size)
        self._pending.append((u, out, timed(work), start))
        ### END SOLUTION

# minitrain-exercises-hash: e357bc62bb021a44
