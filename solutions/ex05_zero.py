"""Chapter 5 solutions — generated from minitrain.zero.partition, minitrain.zero.optimizer, minitrain.zero.data_parallel.

The worked answers. Look one up when you are stuck; the library has them too.
"""

from __future__ import annotations

import functools
import torch
import torch.distributed as dist
from torch import nn
from minitrain import trace
from minitrain.ddp import assign_buckets, broadcast_from_first_rank
from minitrain.zero.accounting import count_sent, optimizer_state_tensors, storage_bytes
from minitrain.zero.buffers import FlatUnit, all_gather_tensor, reduce_scatter_tensor, timed, wait_timed
from minitrain.zero.mixed_precision import cast_inputs, cast_rest, cast_unit


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

# minitrain-exercises-hash: c0c90e27c5648beb
