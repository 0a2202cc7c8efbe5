"""FSDP: ZeRO-3 as frameworks ship it — a module whose parameters *are* this rank's shards.

Chapter 5, notebooks/05_zero.ipynb. Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling
Fully Sharded Data Parallel" (VLDB): the model is cut into *units*; each unit's parameters
live in one flat buffer, padded and split into N equal shards (sections "Sharding Strategies"
and "Flat Parameters"; rank r keeps shard r); a unit is all-gathered just before its forward
and freed after it, gathered again for its backward, and its gradients are reduce-scattered as
soon as its backward is done; the next unit's gather is prefetched ("Communication
Optimizations": backward and forward prefetching). That is ZeRO stage 3 (Rajbhandari et
al. 2020, §5.3), and the schedule is chapter 5's: ``minitrain.zero.ShardedUnits``. What FSDP
adds is the *interface*: the wrapper is an ``nn.Module`` whose ``parameters()`` are the fp32
shards, so an ordinary optimizer (``torch.optim.AdamW(fsdp.parameters())``) steps them and
the training loop is the usual one, plus ``finish_gradient_synchronization()`` — and
``compute_dtype`` ("Native Mixed Precision": gather and compute in bf16/fp16, shards, gradients
and optimizer in fp32) and ``replicated_params`` (kept whole, gradients all-reduced as DDP).
Its units are FSDP1-style (the paper's ``FlatParameter``): one flat shard per unit, the module's
parameters views of the gathered flat buffer. torch's ``fully_shard`` (FSDP2), the notebook's
oracle, shards each parameter as a DTensor of its own and copies them into and out of a flat
buffer around every collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from minitrain.ddp import broadcast_from_first_rank
from minitrain.fsdp.clipping import clip_grad_norm_
from minitrain.fsdp.gathers import UnitGathers
from minitrain.fsdp.shards import register_shards, replicated_ids
from minitrain.runtime import trace
from minitrain.zero.accounting import count_sent
from minitrain.zero.buffers import FlatUnit, all_gather_tensor, reduce_scatter_tensor, timed
from minitrain.zero.mixed_precision import attach_master, cast_inputs, cast_rest
from minitrain.zero.sharded_units import split_into_units, tensors_requiring_grad


class FullyShardedDataParallel(UnitGathers):
    """``FullyShardedDataParallel(module, group=None, compute_dtype=None,
    replicated_params=None, units=None)``.

    Units: ``units`` (default ``module.blocks`` if present, else the children, descending
    into ModuleList / ModuleDict / Sequential: minitrain.zero.units), plus a root unit for
    every other parameter, gathered for the whole forward (embeddings and head bracket the
    blocks); a parameter used while its unit is not gathered raises, naming it. Each unit's
    shard is an ``nn.Parameter`` registered on the unit's module as ``flat_shard`` (the
    root's on ``module``; the replicated parameters' as ``module.flat_replicated``); the
    original parameters become plain attributes, views of the gathered buffer. Ranks may use
    different parameters, skip units and run units out of their listed order (branches
    registered before the trunk): reductions run in one fixed unit order (unused parameters
    contribute zeros; a unit no rank used keeps ``.grad`` None), gathers in unit order in
    each pass, skipped units caught up, and a unit freed before it ran is kept until the
    forward ends, in case it still runs (gathers.py).
    """

    stage = 3  # for the sharded checkpoints of minitrain.zero

    def __init__(self, module, group: ProcessGroup | None = None, compute_dtype=None,
                 replicated_params=None, units=None):
        super().__init__()
        if compute_dtype is not None and (
            not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point
        ):
            raise ValueError(
                f"FullyShardedDataParallel: compute_dtype must be a floating-point torch.dtype "
                f"such as torch.bfloat16, got {compute_dtype!r}"
            )
        self.module, self.group, self.compute_dtype = module, group, compute_dtype
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._original = list(module.named_parameters())  # names for full_state_dict
        named = [(n, p) for n, p in self._original if p.requires_grad]
        if not named:
            raise ValueError("FullyShardedDataParallel: the module has no trainable parameters")
        kinds = {(p.dtype, p.device) for _, p in named}
        if len(kinds) > 1:
            raise ValueError(f"FullyShardedDataParallel: parameters of several kinds: {kinds}")
        self.device = named[0][1].device  # where every flat buffer and flag of this wrapper lives
        whole = replicated_ids(named, replicated_params)
        broadcast_from_first_rank(module, group)  # replicas start from rank 0's weights
        self.blocks, parts = split_into_units(module, named, units, exclude=whole)
        self.units = [FlatUnit(n, ps, self.world_size, self.rank, True) if ps else None
                      for n, ps in parts]  # fmt: skip
        self.root = self.units[-1]
        kept = [(n, p) for n, p in named if id(p) in whole]
        # a "unit of one rank": padded to 1, so its one shard is everything
        self.replicated = FlatUnit("replicated", kept, 1, 0, False) if kept else None
        if self.replicated is not None:
            self.replicated.keep_full = True
        for u in self.live_units():
            attach_master(u, compute_dtype, 0 if u.keep_full else self.rank, not u.keep_full)
        if compute_dtype is not None:
            cast_rest(module, compute_dtype, {id(p) for u in self.live_units() for p in u.params})
        register_shards(self)  # the shards become the module's parameters (shards.py)
        # reductions in the order backward completes units: last block first, root, replicated
        order = [u for u in reversed(self.units[:-1]) if u is not None]
        order += [u for u in (self.root, self.replicated) if u is not None]
        self._gathers = True
        self._init_reduction(order)
        self._init_gathering()

    def live_units(self) -> list:
        """The sharded units that hold parameters, then the replicated one (if any)."""
        extra = [self.replicated] if self.replicated is not None else []
        return [u for u in self.units if u is not None] + extra

    # ------------------------------------------------------------------ forward
    def forward(self, *args, **kwargs):
        if self.compute_dtype is not None:
            args = cast_inputs(args, self.compute_dtype)
            kwargs = cast_inputs(kwargs, self.compute_dtype)
            with torch.no_grad():  # the optimizer stepped the fp32 masters: round them in
                for u in self.live_units():
                    u.shard.copy_(u.master)
        self._begin_forward()
        # a data-dependent branch may skip units, ranks may run different ones: gathers go in
        # unit order on every rank, skipped units caught up and freed at the end (they pair
        # by position: gathers.py)
        return self._sharded_forward(*args, **kwargs)

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

    # ------------------------------------------------------------------ gradients
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

    def _launch_remaining(self):
        """End of backward (its gathers all launched: gathers.py). As DDP leaves ``.grad`` of
        a parameter no rank used alone, so does FSDP for a *unit* no rank used (AdamW must not
        decay it): after every reduction is launched — the same position on every rank — one
        small all-reduce of "used" flags."""
        # on the device of the gradients it is reduced beside (NCCL takes no CPU tensor)
        used = torch.tensor([float(u.ready > 0) for u in self._reduce_order], device=self.device)
        super()._launch_remaining()
        dist.all_reduce(used, group=self.group)
        self._unused = {id(u) for u, n in zip(self._reduce_order, used.tolist()) if n == 0}

    def _store_reduced(self, u, out):
        """The averaged gradient of ``u``'s shard becomes (or adds to) the shard's ``.grad``."""
        if id(u) in self._unused:
            return  # no rank used it: its .grad stays as it was (None after zero_grad)
        g = u.master.grad
        u.master.grad = out if g is None else g.add_(out)

    def finish_gradient_synchronization(self) -> None:
        """Wait for every unit's reduction and write the shards' ``.grad``. Runs by itself at
        the end of backward (an autograd callback, as torch's FSDP); a second call is a no-op."""
        if self._pending or self._callback_queued:
            self._finish_backward()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale all gradients so their global norm is at most ``max_norm``; return the norm
        before clipping, equal to ``torch.nn.utils.clip_grad_norm_`` on the whole model."""
        return clip_grad_norm_(self, max_norm, norm_type)

    # ------------------------------------------------------------------ state
    def full_state_dict(self) -> dict:
        """name → full fp32 parameter (a copy) for every parameter, as named in the original
        module's ``named_parameters()``, on every rank: the masters, all-gathered."""
        out = {}
        for u in self.live_units():
            flat = u.master.detach()
            if not u.keep_full:
                flat = torch.empty(u.padded, dtype=flat.dtype, device=flat.device)
                all_gather_tensor(flat, u.master.detach(), group=self._gather_group)
            for k, name in enumerate(u.names):
                out[name] = u.slot(flat, k).view(u.shapes[k]).clone()
        for name, p in self._original:
            if name not in out:  # frozen parameters are not sharded
                out[name] = p.detach().clone()
        return {name: out[name] for name, _ in self._original}

    def refresh_from_shards(self) -> None:
        """After a checkpoint was loaded into the masters: drop pending gradients; the next
        forward gathers (and, under compute_dtype, rounds) the new values."""
        for u in self.live_units():
            u.master.grad = None
            self._free(u)

    def padded_numel(self) -> int:
        """Ψ as sharded: every sharded unit's size rounded up to a multiple of N."""
        return sum(u.padded for u in self.live_units() if not u.keep_full)
