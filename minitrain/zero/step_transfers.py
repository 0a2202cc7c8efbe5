"""What ``ZeroDataParallel.step`` moves around the optimizer's update, stage by stage.

Chapter 5, notebooks/05_zero.ipynb (Rajbhandari et al. 2020, §5 and §7). The update itself is
the optimizer's, on this rank's fp32 shard; around it:

- stage 1: the gradients, accumulated by autograd into one flat buffer per bucket
  (``point_gradients_at_buffer``), are reduce-scattered now and averaged — each rank keeps the
  average of its slice only (stages 2-3 did this during backward);
- every stage: the shard gradients are handed to the optimizer's masters (to the host under
  ZeRO-Offload, Ren et al. 2021: copies queued on the stream, waited for once);
- after the update: a separate master (fp32 under ``compute_dtype``, or on the host) is rounded
  back into the unit's shard, and stages 1-2 all-gather the updated shards so every rank holds
  the whole model again (stage 3 gathers per unit in the next forward).
"""

from __future__ import annotations

import torch

from minitrain.runtime import trace
from minitrain.zero.accounting import count_sent
from minitrain.zero.buffers import all_gather_tensor, reduce_scatter_tensor
from minitrain.zero.mixed_precision import host_buffer, wait_for_host_copies


def point_gradients_at_buffer(u) -> None:
    """Stage 1: each parameter's ``.grad`` becomes a view of unit ``u``'s flat ``grad_full``,
    which autograd then accumulates into (no copy at the step)."""
    for k, p in enumerate(u.params):
        p.grad = u.slot(u.grad_full, k).view_as(p)


def reduce_scatter_gradients(units: list, group, world_size: int) -> None:
    """Stage 1, at the step: each unit's flat gradient, in fp32, reduce-scattered and averaged
    into ``u.grad_shard`` (a ``.grad`` someone replaced is copied in first; None counts zero)."""
    for u in units:
        for k, p in enumerate(u.params):  # a grad someone replaced: copy it in
            slot = u.slot(u.grad_full, k)
            if p.grad is None:
                slot.zero_()
            elif p.grad.data_ptr() != slot.data_ptr():
                slot.copy_(p.grad.reshape(-1))
        grad_full = u.grad_full.to(u.master.dtype)  # fp32 for the sum (one unit at a time)
        u.grad_shard = torch.empty(u.shard_numel, dtype=grad_full.dtype, device=grad_full.device)
        reduce_scatter_tensor(u.grad_shard, grad_full, group=group)
        count_sent("reduce_scatter", u.padded * grad_full.element_size(), world_size)
        u.grad_shard.div_(world_size)


def hand_gradients_to_masters(units: list, offload: bool, device) -> None:
    """Each unit's averaged shard gradient (zeros if no rank produced one) becomes its
    master's ``.grad``; under ``offload`` copied to the host, waited for once at the end."""
    for u in units:
        g = u.grad_shard if u.grad_shard is not None else torch.zeros_like(u.master)
        if offload:  # to the host: queued on the stream, waited for once below
            u.master.grad = host_buffer(g, u.master.device, u.master.dtype)
            u.master.grad.copy_(g, non_blocking=True)
        else:
            u.master.grad = g.to(u.master.device)
    if offload:
        wait_for_host_copies(device)


def write_back_shards(units: list, stage: int, separate_master: bool, offload: bool, group,
                      world_size: int) -> None:
    """After the update: a separate master rounded back into its unit's shard, the step's
    gradients dropped, and (stages 1-2) the updated shards all-gathered into ``u.full``."""
    with torch.no_grad():
        for u in units:
            if separate_master:  # the updated slice, rounded, travels back to the unit
                # (from pinned memory without stalling the host; the all-gather after it
                # is on the same stream, so it reads the copied values)
                u.shard.copy_(u.master, non_blocking=offload)
            u.master.grad = None
            if stage == 1:
                u.grad_shard = None
            if stage < 3:
                t0 = trace.now(u.full.device)  # (a GPU's events: issue 41)
                all_gather_tensor(u.full, u.shard.clone(), group=group)
                count_sent("all_gather", u.padded * u.full.element_size(), world_size)
                trace.record(f"all-gather {u.name}", "communication", t0, trace.now(u.full.device))
