"""Expert parallelism: the experts spread over the ranks of a group, tokens moved to them
and back with two all-to-alls (chapter 8, notebook 08).

GShard (Lepikhin et al. 2020, section 2.2) and Switch (Fedus et al. 2021, section 2.2,
Figure 3). With E experts over P ranks, rank p holds experts [p·E/P, (p+1)·E/P). Every rank
routes *its own* tokens with a replicated router, then:

    counts:   all-to-all of the per-expert counts: how many rows each rank will receive
    dispatch: all-to-all of the rows (uneven splits), then sort them by local expert
    experts:  each local expert on its contiguous block
    combine:  un-sort, all-to-all back (the same splits reversed), un-sort, weight, sum

The exchange itself is ``dispatchers.AllToAllDispatcher``; this file makes an ``MoELayer``
expert-parallel and keeps its gradients right. Backward runs both all-to-alls in reverse
(``all_to_all.AllToAll``). The router is
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
from torch.distributed import ProcessGroup

from minitrain.moe.dispatchers import AllToAllDispatcher
from minitrain.moe.layer import MoELayer


class ExpertParallelMoE(MoELayer):
    """An ``MoELayer`` whose experts are spread over the ranks of ``group``: the same router,
    this rank's share of the experts, and an all-to-all dispatcher."""

    @classmethod
    def from_local(cls, layer: MoELayer, group: ProcessGroup | None = None) -> ExpertParallelMoE:
        """The same weights as ``layer``; this rank keeps its contiguous share of experts."""
        dispatcher = AllToAllDispatcher(layer.num_experts, group)
        per_rank, rank = dispatcher.local_experts, dist.get_rank(group)
        ep = cls(layer.d_model, layer.d_ff, layer.num_experts, layer.top_k,
                 router=copy.deepcopy(layer.router),
                 experts=layer.experts.shard(rank * per_rank, per_rank), dispatcher=dispatcher)
        ep.aux_loss_in_backward, ep.aux_loss_scale = (layer.aux_loss_in_backward,
                                                      layer.aux_loss_scale)
        return ep

    @property
    def group(self) -> ProcessGroup | None:
        return self.dispatcher.group

    @property
    def world(self) -> int:
        return self.dispatcher.world

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
