"""Expert parallelism: the experts spread over the ranks of a group, tokens moved to them
and back with two all-to-alls (chapter 8, notebook 08).

GShard (Lepikhin et al. 2020, section 2.2) and Switch (Fedus et al. 2021, section 2.2,
Figure 3). With E experts over P ranks, rank p holds experts [p·E/P, (p+1)·E/P). Every rank
routes *its own* tokens with a replicated router, then:

    counts:   all-to-all of the per-expert counts: how many rows each rank will receive
    dispatch: all-to-all of the rows (uneven splits), then sort them by local expert
    experts:  each local expert on its contiguous block
    combine:  un-sort, all-to-all back (the same splits reversed), un-sort, weight, sum

Backward runs both all-to-alls in reverse (``all_to_all.AllToAll``). The router is
replicated: like data parallelism, ``finish_gradient_synchronization`` averages its
gradient over the group. The ranks act as data-parallel ranks for the experts too: the
gradient an expert receives through the all-to-all is the *sum* over the ranks' losses, so
it is divided by P — then every gradient equals the local layer's for the mean of the ranks'
losses.

Capacity: each rank computes ⌈C·k·T_r/E⌉ over its own T_r tokens and drops on its own, as
the local layer would for those tokens; so expert parallelism gives every rank exactly the
local layer's output for its tokens (an expert may then receive up to P times the
per-rank capacity in total).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from minitrain.moe.all_to_all import all_to_all, check_splits, exchange_counts
from minitrain.moe.dispatch import assignments, combine, sort_by_expert, unsort
from minitrain.moe.layer import MoELayer
from minitrain.runtime import trace


class ExpertParallelMoE(nn.Module):
    """An ``MoELayer`` whose experts are spread over the ranks of ``group``."""

    aux_loss_in_backward = False
    aux_loss_scale = 1.0

    def __init__(self, router, experts, num_experts: int, top_k: int, group=None):
        super().__init__()
        self.router, self.experts, self.group = router, experts, group
        self.num_experts, self.top_k = num_experts, top_k
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.local_experts = num_experts // self.world
        self.d_model = experts.d_model
        self.last_routing = None

    @classmethod
    def from_local(cls, layer: MoELayer, group=None) -> ExpertParallelMoE:
        """The same weights as ``layer``; this rank keeps its contiguous share of experts."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if layer.num_experts % world:
            raise ValueError(f"num_experts={layer.num_experts} is not divisible by the "
                             f"expert-parallel size {world}")
        per_rank = layer.num_experts // world
        ep = cls(copy.deepcopy(layer.router), layer.experts.shard(rank * per_rank, per_rank),
                 layer.num_experts, layer.top_k, group)
        ep.aux_loss_in_backward, ep.aux_loss_scale = (layer.aux_loss_in_backward,
                                                      layer.aux_loss_scale)
        return ep

    @property
    def aux_loss(self) -> torch.Tensor:
        return self.router.aux_loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, x = x.shape[:-1], x.reshape(-1, self.d_model)
        P, E_local = self.world, self.local_experts
        with trace.span("route", "compute"):
            routing = self.router(x)
            tokens, experts, weights = assignments(routing.indices, routing.weights, routing.keep)
            # sorted by global expert = grouped by destination rank (experts are contiguous)
            rows, order, counts = sort_by_expert(x[tokens], experts, self.num_experts)
        with trace.span("dispatch", "communication"):
            received_counts = exchange_counts(counts, self.group).view(P, E_local)
            send_splits = counts.view(P, E_local).sum(dim=1).tolist()
            recv_splits = received_counts.sum(dim=1).tolist()
            check_splits(send_splits, recv_splits, self.group)
            received = all_to_all(rows, recv_splits, send_splits, self.group, "dispatch")
        with trace.span("expert compute", "compute"):
            # received rows come grouped by source rank, then by local expert: regroup
            local_ids = torch.arange(E_local).repeat(P).repeat_interleave(
                received_counts.reshape(-1))
            grouped, local_order, local_counts = sort_by_expert(received, local_ids, E_local)
            out = unsort(self.experts(grouped, local_counts.tolist()), local_order)
        with trace.span("combine", "communication"):
            returned = all_to_all(out, send_splits, recv_splits, self.group, "combine")
            y = combine(unsort(returned, order), tokens, weights, x.shape[0])
        self.last_routing = routing
        return MoELayer.attach_aux_loss(self, y).reshape(*lead, self.d_model)

    def finish_gradient_synchronization(self) -> None:
        """After backward: average the replicated router's gradient over the group, and
        divide the experts' by P (see the module docstring)."""
        for p in self.router.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)
                p.grad /= self.world
        for p in self.experts.parameters():
            if p.grad is not None:
                p.grad /= self.world

    @torch.no_grad()
    def update_bias(self) -> None:
        """DeepSeek-V3's bias step with the load summed over the group (same bias everywhere)."""
        load = self.router.observed_load.clone()
        dist.all_reduce(load, group=self.group)
        self.router.update_bias(load)
