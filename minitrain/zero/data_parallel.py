"""ZeRO: shard optimizer state, gradients and parameters across data-parallel ranks.

Chapter 5, notebooks/05_zero.ipynb. Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models" (SC'20). Plain data parallelism keeps a full
copy of the *model states* on every rank: with Adam in mixed precision 2Ψ (fp16 weights)
+ 2Ψ (fp16 gradients) + KΨ (fp32 master, momentum, variance; K = 12) bytes. ZeRO splits
them into N slices, rank r keeping slice r (§5, Figure 1):

- stage 1 (P_os): optimizer state only          2Ψ + 2Ψ + KΨ/N
- stage 2 (P_os+g): gradients too               2Ψ + (2 + K)Ψ/N
- stage 3 (P_os+g+p): parameters too            (2 + 2 + K)Ψ/N

By default this course runs fp32, so the same formulas read 4Ψ + 4Ψ + 8Ψ/N etc.
(``memory_formula``); ``compute_dtype=torch.bfloat16`` gives the paper's mixed precision
(mixed_precision.py), and ``loss_scaler`` its dynamic loss scaling, agreed by all ranks.
Communication (§7): stages 1 and 2 reduce-scatter the gradients and all-gather the updated
parameters, the same 2Ψ as DP's all-reduce; stage 3 gathers the parameters twice (forward
and backward) and reduce-scatters the gradients: 3Ψ (``communication_formula``).

Two ways in: ``ShardedOptimizer`` (ZeRO-1 as a drop-in optimizer, used under DDP) and
``ZeroDataParallel`` (the data-parallel wrapper, stages 1-3, with optional CPU offload of
the optimizer, Ren et al. 2021 "ZeRO-Offload"). This file is ``ZeroDataParallel``; the
package's other files: partition.py and optimizer.py (ZeRO-1), buffers.py (flat padded
units), mixed_precision.py (low-precision units, fp32 master shards), step_transfers.py (what
the step moves around the update), accounting.py (formulas and byte counts), checkpoint.py
(sharded checkpoints).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from minitrain.ddp import assign_buckets, broadcast_from_first_rank
from minitrain.runtime import trace
from minitrain.zero.accounting import optimizer_state_tensors, storage_bytes
from minitrain.zero.buffers import FlatUnit, all_gather_tensor
from minitrain.zero.gather_order import OrderedGathers
from minitrain.zero.mixed_precision import attach_master, cast_inputs, cast_rest
from minitrain.zero.sharded_units import split_into_units
from minitrain.zero.step_transfers import (
    hand_gradients_to_masters,
    point_gradients_at_buffer,
    reduce_scatter_gradients,
    write_back_shards,
)


class ZeroDataParallel(OrderedGathers):
    """Data parallelism with ZeRO ``stage`` 1, 2 or 3 over the ranks of ``group``.

    ``ZeroDataParallel(model, torch.optim.AdamW, stage=2, lr=1e-3)``: call it like the
    model, ``loss.backward()``, ``step()``, ``zero_grad()``. Each rank feeds its own slice of
    the batch; the gradients are averaged over ranks (reduce-scatter, so each rank gets the
    average of its slice only) before the optimizer sees them. ``**kw`` go to ``optimizer_cls``
    (one parameter group). ``bucket_cap_mb``: gradient bucket size of stages 1-2. Stage 3
    gathers per *unit*: ``units`` (modules; default: units.py's, ``module.blocks`` or else the
    children, descending into containers) plus a root unit for every other parameter; a use
    of a parameter whose unit is not gathered raises. ``offload=True``: ZeRO-Offload, master
    slice, Adam's moments and step on the host (``"cpu"``); parameters and the averaged fp32
    gradient slice stay on the device (Ren et al. 2021 move the gradients too, in backward).

    Ranks may use different parameters (data-dependent branches): every unit's gradients are
    reduce-scattered in one fixed order on every rank — a complete unit waits for all earlier
    ones, as chapter 4's buckets do — and a parameter this rank did not use contributes zeros
    at the end of backward. A parameter *no* rank used gets a zero gradient (a flat shard
    cannot tell "unused" from "zero"), so unlike DDP's ``None`` AdamW still decays it. Stage
    3 gathers on a second process group of the same ranks, so its gathers and reduce-scatters
    each keep one order on every rank. It gathers a unit when its forward runs; a rank
    skipping a unit launches its gathers anyway, in unit order (gather_order.py).

    ``compute_dtype`` (e.g. ``torch.bfloat16``): parameters are held, gathered and used for
    forward/backward in that dtype (floating-point inputs are cast to it); each rank keeps an
    fp32 master of its shard (``unit.master``) and fp32 optimizer state; gradients are cast
    to fp32 before they are reduce-scattered; the step rounds the masters back into the
    units (Micikevicius et al. 2018; mixed_precision.py). ``loss_scaler`` (a
    ``minitrain.precision.DynamicLossScaler``): scale the loss with it
    (``zdp.loss_scaler.scale(loss).backward()``); ``step()`` unscales the fp32 shard
    gradients, skips the update on *every* rank if any rank's shard held inf/NaN, and calls
    ``update()``, so the scale stays the same on all ranks.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer_cls,
        stage: int,
        group: ProcessGroup | None = None,
        bucket_cap_mb: float = 25.0,
        compute_dtype: torch.dtype | None = None,
        loss_scaler=None,
        offload: bool = False,
        units=None,
        **kw,
    ):
        super().__init__()
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeroDataParallel: stage must be 1, 2 or 3, got {stage!r}")
        if compute_dtype is not None and not compute_dtype.is_floating_point:
            raise ValueError(
                "ZeroDataParallel: compute_dtype must be a floating-point dtype, "
                f"got {compute_dtype!r}"
            )
        self.module, self.stage, self.group, self.offload = module, stage, group, offload
        self.compute_dtype, self.loss_scaler = compute_dtype, loss_scaler
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("ZeroDataParallel: the module has no trainable parameters")
        kinds = {(p.dtype, p.device) for _, p in named}
        if len(kinds) > 1:
            raise ValueError(
                f"ZeroDataParallel: all parameters must share one dtype and device, got {kinds}"
            )
        self.device = named[0][1].device  # where the units, buffers and flags live
        broadcast_from_first_rank(module, group)  # replicas start from rank 0's weights
        if stage < 3:  # chapter 4's buckets: reverse registration order, closed at the cap
            buckets = assign_buckets([p for _, p in named], bucket_cap_mb * 2**20)
            parts = [(f"bucket {i}", [named[k] for k in b]) for i, b in enumerate(buckets)]
            self.blocks = []
        else:  # ShardedUnits: a unit per block, plus the root
            self.blocks, parts = split_into_units(module, named, units)
        self.units = [
            FlatUnit(name, ps, self.world_size, self.rank, own_shard=stage == 3) if ps else None
            for name, ps in parts
        ]
        self.root = self.units[-1] if stage == 3 else None
        self.units = [u for u in self.units if u is not None] if stage < 3 else self.units
        self._where = {p: (u, k) for u in self.live_units() for k, p in enumerate(u.params)}
        # the optimizer steps a separate fp32 tensor when it lives on the host or the units
        # hold a low precision; otherwise the master *is* the shard (no copy)
        self._separate_master = offload or compute_dtype is not None
        for u in self.live_units():
            host = torch.device("cpu") if offload else None
            attach_master(u, compute_dtype, self.rank, own_shard=stage == 3, host=host)
            if stage == 1:  # p.grad are views of one flat buffer, which autograd accumulates into
                u.grad_full = torch.zeros_like(u.full)
                point_gradients_at_buffer(u)
        if compute_dtype is not None:
            cast_rest(module, compute_dtype, {id(p) for p in self._where})
        self.optimizer = optimizer_cls([u.master for u in self.live_units()], **kw)
        # the order every rank reduce-scatters its units in: the order backward normally
        # completes them (stages 1-2: the buckets; stage 3: last block first, the root last)
        if stage < 3:
            order = list(self.units)
        else:
            order = [u for u in reversed(self.units[:-1]) if u is not None]
            order += [self.root] if self.root is not None else []
        self._gathers = stage == 3
        self._init_reduction(order, hooks=stage > 1)
        if stage == 3:
            self._init_gathering()

    # ------------------------------------------------------------------ forward
    def forward(self, *args, **kwargs):
        if self.compute_dtype is not None:
            args = cast_inputs(args, self.compute_dtype)
            kwargs = cast_inputs(kwargs, self.compute_dtype)
        if self.stage < 3:
            return self.module(*args, **kwargs)
        return self._sharded_forward(*args, **kwargs)

    # ------------------------------------------------------------------ stage 3 hooks (exercises)
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

    def _store_reduced(self, u, out):
        """An averaged gradient slice (ShardedUnits): added to this rank's shard gradient."""
        u.grad_shard = out if u.grad_shard is None else u.grad_shard.add_(out)

    # ------------------------------------------------------------------ the step
    def step(self):
        """Average gradients (stage 1: now, stages 2-3: done during backward), update this
        rank's shard, then (stages 1-2) all-gather the updated parameters. With a
        ``loss_scaler``: unscale, agree on overflow across ranks, step or skip, update S.
        What moves around the update is step_transfers.py's."""
        units = self.live_units()
        if self.stage == 1:
            reduce_scatter_gradients(units, self.group, self.world_size)
        hand_gradients_to_masters(units, self.offload, self.device)
        with trace.span("optimizer step", "compute", self.device):
            if self.loss_scaler is None:
                self.optimizer.step()
            else:
                self._scaled_step()
        write_back_shards(units, self.stage, self._separate_master, self.offload, self.group,
                          self.world_size)

    def _scaled_step(self):
        """Dynamic loss scaling over shards (skipping: Micikevicius et al. 2018, §3.2; growing and
        backing off: NVIDIA Apex, as GradScaler): a rank sees its slice of the gradients only, so
        an overflow may show on one rank alone. The verdict is all-reduced first: all skip or step."""
        scaler = self.loss_scaler
        scaler.unscale_(self.optimizer)  # this rank's fp32 shard gradients ÷ S, its inf check
        scaler.all_reduce_found_inf(self.optimizer, self.group)  # inf anywhere → inf everywhere
        scaler.step(self.optimizer)  # skipped on every rank, or taken on every rank
        scaler.update()

    def zero_grad(self, set_to_none: bool = True):
        for u in self.live_units():
            u.grad_shard = None
            if self.stage == 1:
                u.grad_full.zero_()
                point_gradients_at_buffer(u)

    # ------------------------------------------------------------------ inspection
    def full_state_dict(self) -> dict:
        """name → full parameter (a copy), as in the wrapped module's ``named_parameters()``."""
        out = {}
        for u in self.live_units():
            was_free = u.state == "free"
            self._wait_gather(u)
            for name, p in zip(u.names, u.params):
                out[name] = p.detach().clone()
            if was_free:
                self._free(u)
        for name, p in self.module.named_parameters():
            if name not in out:  # frozen parameters are not sharded
                out[name] = p.detach().clone()
        return {name: out[name] for name, _ in self.module.named_parameters()}

    def memory_bytes(self) -> dict:
        """Bytes this rank holds now, accounted from the tensors it keeps (not from formulas):
        params (module parameters' storages + stage 3 shards), grads, optimizer state on the
        device, and "host": what offload keeps on the host (master shards + their state)."""
        units = self.live_units()
        params = [p for p in self.module.parameters()] + [u.shard for u in units]
        grads = [p.grad for p in self.module.parameters()]
        grads += [t for u in units for t in (u.grad_full, u.grad_shard)]
        state = optimizer_state_tensors(self.optimizer)
        # a separate master is optimizer state (the paper's K = 12 counts it); otherwise it
        # is the shard itself, already counted in "params"
        state += [u.master for u in units] if self._separate_master else []
        return {
            "params": storage_bytes(params),
            "grads": storage_bytes(grads),
            "optimizer": 0 if self.offload else storage_bytes(state),
            "host": storage_bytes(state) if self.offload else 0,
        }

    def refresh_from_shards(self) -> None:
        """Make the module's parameters match the shards (after loading a checkpoint into
        them): stages 1-2 all-gather them now, stage 3 frees them so the next forward
        gathers the new values. Pending gradients are dropped."""
        for u in self.live_units():
            u.grad_shard, u.master.grad = None, None
            if self.stage < 3:
                all_gather_tensor(u.full, u.shard.clone(), group=self.group)
            else:
                self._free(u)

    def padded_numel(self) -> int:
        """Ψ as stored: every unit's size rounded up to a multiple of N (the padding)."""
        return sum(u.padded for u in self.live_units())
