"""Per-unit gather, free, prefetch and strictly ordered gradient reduction, written once.

Chapter 5, notebooks/05_zero.ipynb. ZeRO stage 3 (Rajbhandari et al. 2020, §5.3) and FSDP
(Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel", §3)
run the same schedule: a unit's parameters are all-gathered just before its forward and
freed after it, gathered again for its backward and freed once its gradients are out, the
next unit's gather prefetched meanwhile, and each unit's gradients reduce-scattered as soon
as the unit is done, strictly in one unit order on every rank. ``ShardedUnits`` is that
schedule; ``ZeroDataParallel`` (data_parallel.py: ZeRO stages 2-3, owns its optimizer) and
``minitrain.fsdp.FullyShardedDataParallel`` (an external optimizer steps its shards) are
built on it. A subclass provides ``_pre_forward(index)`` / ``_post_forward(index, output)``
(what a block's forward hooks do: the chapter's exercises) and ``_store_reduced(u, out)``
(where an averaged gradient slice goes), and sets the attributes listed in ``__init__``.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from minitrain.runtime import trace
from minitrain.zero.accounting import count_sent
from minitrain.zero.buffers import all_gather_tensor, reduce_scatter_tensor, timed, wait_timed
from minitrain.zero.units import (  # noqa: F401 (split_into_units: imported from here too)
    UngatheredParameterError,
    guard_parameter_use,
    note_ungathered,
    split_into_units,
    ungathered_gradient_error,
)


def tensors_requiring_grad(out) -> list:
    """The tensors in ``out`` (nested lists, tuples, dicts) that autograd will differentiate."""
    if isinstance(out, torch.Tensor):
        return [out] if out.requires_grad else []
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in tensors_requiring_grad(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in tensors_requiring_grad(o)]
    return []


class ShardedUnits(nn.Module):
    """The gather/free/prefetch hooks and the ordered reduce-scatters over ``FlatUnit``\\ s.

    A subclass sets: ``module``, ``group``, ``world_size``, ``rank``, ``device`` (where the
    units live: its clock times the trace, ``trace.now(device)``); ``units`` (the units in
    ``blocks`` order, ``None`` for a block without parameters, then the root unit), ``root``,
    ``blocks``; ``_gathers`` (parameters sharded: gather/free them) and calls
    ``_init_reduction(order)`` and, if it gathers, ``_init_gathering()``.
    """

    def live_units(self) -> list:
        """The units that hold parameters (a block may have none)."""
        return [u for u in self.units if u is not None]

    def _init_reduction(self, order: list, hooks: bool = True) -> None:
        self._reduce_order = list(order)  # every rank reduces its units in this one order
        self._to_reduce = list(order)
        self._pending, self._callback_queued = [], False
        self._where = {p: (u, k) for u in order for k, p in enumerate(u.params)}
        for p in self._where if hooks else ():
            p.register_post_accumulate_grad_hook(self._grad_hook)

    def _init_gathering(self) -> None:
        # Backward issues all-gathers (re-gather, prefetch) between the reduce-scatters, and
        # which reduce-scatters come before a given gather depends on the parameters this rank
        # used. Collectives of one group pair up by position, so the two kinds travel on two
        # groups of the same ranks, each in one order on every rank (FSDP's two streams).
        # new_group's default asks every rank of the world to call it; with data parallelism
        # inside a larger mesh only this group's ranks are here, so they synchronize locally.
        ranks = None if self.group is None else dist.get_process_group_ranks(self.group)
        self._gather_group = dist.new_group(ranks, use_local_synchronization=True)
        for i, block in enumerate(self.blocks):
            block.register_forward_pre_hook(functools.partial(self._pre_hook, i))
            block.register_forward_hook(functools.partial(self._post_hook, i))
        self._gathered = sum(u.full.untyped_storage().nbytes() for u in self.live_units())
        for u in self.live_units():
            self._free(u)
        self.peak_gathered_bytes = 0
        # after the gathering hooks: a module's check runs once its unit's hook gathered it
        guard_parameter_use(self, [u for u in self.live_units() if not u.keep_full])

    def reset_peak_gathered_bytes(self) -> None:
        """Start measuring the most bytes of gathered (full) units held at one time anew."""
        self.peak_gathered_bytes = self._gathered

    # ------------------------------------------------------------------ forward
    def _sharded_forward(self, *args, **kwargs):
        """The root unit (embeddings, head) gathered for the whole forward, the first block
        prefetched, the blocks gathered and freed by their hooks."""
        if self.root is not None:
            self._wait_gather(self.root)
        if self.units[0] is not None and self.blocks:
            self._start_gather(self.units[0])  # prefetch the first block
        try:
            out = self.module(*args, **kwargs)  # (each block's forward is traced by its hooks)
        except RuntimeError as exc:  # e.g. a shape error from a freed parameter read directly
            if not isinstance(exc, UngatheredParameterError):
                note_ungathered(exc, self)
            raise
        if self.root is not None:
            self._free(self.root)
        if torch.is_grad_enabled():
            for t in tensors_requiring_grad(out):
                t.register_hook(self._backward_begins)
        return out

    # ------------------------------------------------------------------ gather and free
    def _start_gather(self, u):
        """Re-allocate ``u.full`` and launch the all-gather of every rank's shard into it."""
        if u is None or u.state != "free":
            return
        u.full.untyped_storage().resize_(u.padded * u.full.element_size())
        self._gathered += u.padded * u.full.element_size()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._gathered)
        u.launched = trace.now(u.full.device)  # (a GPU's event: issue 41)
        # .data: the collective writes through an alias with its own version counter, so the
        # tensors autograd saved (views of u.full) are not flagged as modified in place
        u.work = timed(
            all_gather_tensor(u.full.data, u.shard, group=self._gather_group, async_op=True)
        )
        count_sent("all_gather", u.padded * u.full.element_size(), self.world_size)
        u.state = "gathering"

    def _wait_gather(self, u):
        if u is None:
            return
        self._start_gather(u)
        if u.state == "gathering":
            trace.record(f"gather {u.name}", "communication", u.launched,
                         wait_timed(u.work, u.full.device))
            u.state, u.work = "full", None
            u.show_params()  # only now: a gather in flight is not yet data

    def _free(self, u):
        """Give ``u.full``'s memory back; the parameters hold an empty tensor meanwhile."""
        if u is None or u.state == "free" or u.keep_full:
            return
        if u.state == "gathering":
            wait_timed(u.work)
        with trace.span(f"free {u.name}", "memory", u.full.device):
            u.full.untyped_storage().resize_(0)
            u.hide_params()
        self._gathered -= u.padded * u.full.element_size()
        u.state = "free"

    def _pre_hook(self, index, module, args):
        self._pre_forward(index)  # looked up at call time, so a grader's version runs

    def _post_hook(self, index, module, args, output):
        self._post_forward(index, output)

    def _pre_backward(self, index):
        """Block ``index`` is about to run backward: gather it, prefetch the one before it."""
        self._arm_callback()
        self._wait_gather(self.units[index])
        if index > 0:
            self._start_gather(self.units[index - 1])
        if self.units[index] is not None:
            self.units[index].backward_start = trace.now(self.device)

    def _backward_begins(self, grad):
        self._arm_callback()
        self._wait_gather(self.root)  # the head's backward comes first
        if self.blocks:
            self._start_gather(self.units[len(self.blocks) - 1])

    # ------------------------------------------------------------------ gradients
    def _arm_callback(self):
        if not self._callback_queued:  # runs once, when the whole backward is done
            self._callback_queued, self._backward_start = True, trace.now(self.device)
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _new_grad_full(self, u):
        # fp32 under compute_dtype: low-precision gradients are summed, and reduced, in fp32
        return torch.zeros(u.padded, dtype=u.master.dtype, device=u.shard.device)

    def _grad_hook(self, param):
        """Autograd calls this once ``param.grad`` holds the gradient (it passes the parameter):
        copy it into its unit's flat buffer and drop it; complete units start their
        reduce-scatters, in order."""
        self._arm_callback()
        u, k = self._where[param]
        if param.grad.shape != u.shapes[k]:  # computed from a freed parameter's empty tensor
            raise ungathered_gradient_error(self, u, k, param.grad)
        if u.grad_full is None:  # allocated by the unit's first gradient, freed once reduced
            u.grad_full = self._new_grad_full(u)
        u.slot(u.grad_full, k).add_(param.grad.reshape(-1))
        param.grad = None
        u.ready += 1
        if u.ready == len(u.params):
            if self._gathers:  # every use of its parameters in backward is done: free them
                if u.backward_start is not None:  # (its gradients are safe in u.grad_full)
                    trace.record(f"backward {u.name}", "compute", u.backward_start,
                                 trace.now(self.device))
                    u.backward_start = None
                self._free(u)
            self._launch_ready_units()

    def _launch_ready_units(self):
        """Start the reduction of each complete unit, strictly in ``self._reduce_order``:
        a collective pairs the i-th call of every rank, so all ranks must launch the units in
        one order even when they used different parameters and completed them differently
        (chapter 4's ``_launch_ready_buckets``)."""
        while self._to_reduce:
            u = self._to_reduce[0]
            if u.ready < len(u.params):
                return  # a later unit may be complete, but it must wait for this one
            self._launch_reduce_scatter(self._to_reduce.pop(0))

    def _launch_reduce_scatter(self, u):
        out = torch.empty(u.shard_numel, dtype=u.grad_full.dtype, device=u.grad_full.device)
        u.launched = trace.now(out.device)
        work = timed(reduce_scatter_tensor(out, u.grad_full, group=self.group, async_op=True))
        count_sent("reduce_scatter", u.padded * u.grad_full.element_size(), self.world_size)
        self._pending.append((u, out, work, u.launched))

    def _finish_backward(self):
        """End of backward: reduce what is left, wait for all, hand each average on."""
        if not self._gathers:  # (with gathers, each block's backward is recorded instead)
            trace.record("backward", "compute", self._backward_start, trace.now(self.device))
        self._launch_remaining()
        self._wait_reductions()

    def _launch_remaining(self):
        for u in self._to_reduce:  # parameters this rank did not use contribute zeros
            if u.grad_full is None:
                u.grad_full = self._new_grad_full(u)
            u.ready = len(u.params)
        self._launch_ready_units()

    def _wait_reductions(self):
        for u, out, work, launched in self._pending:
            kind = "all-reduce" if u.keep_full else "reduce-scatter"
            trace.record(f"{kind} {u.name}", "communication", launched,
                         wait_timed(work, out.device))
            self._store_reduced(u, out.div_(self.world_size))
            u.grad_full, u.ready = None, 0
        if self._gathers:
            for u in self.live_units():
                self._free(u)
        self._pending, self._callback_queued = [], False
        self._to_reduce = list(self._reduce_order)
