"""Where the rows sorted by expert are computed: here, or on the ranks holding their experts
(chapter 8, notebook 08).

``MoELayer`` routes, sorts the rows by expert, hands them to its dispatcher, and combines what
comes back; only the dispatcher knows where the experts live (Megatron-Core's token-dispatcher
idea: one layer, the communication a part you swap).

- ``LocalDispatcher``: every expert is on this process; the rows go straight to them.
- ``AllToAllDispatcher``: expert parallelism (GShard, Lepikhin et al. 2020, section 2.2;
  Switch, Fedus et al. 2021, Figure 3). With E experts over P ranks, rank p holds experts
  [p·E/P, (p+1)·E/P). The rows, sorted by global expert, are already grouped by destination
  rank: an all-to-all of the per-expert counts tells each rank what it receives, an
  all-to-all of the rows (uneven splits) takes them there, the local experts run, and the
  same all-to-all reversed brings the outputs back in the order they left.

Both take ``(rows sorted by expert, counts per expert, experts)`` and return the experts'
outputs in the rows' order, so the layer around them is the same.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from minitrain.moe.all_to_all import all_to_all, check_splits, exchange_counts
from minitrain.moe.dispatch import sort_by_expert, unsort
from minitrain.runtime import trace


class LocalDispatcher:
    """All experts on this process: expert e computes its contiguous block of rows."""

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts) -> torch.Tensor:
        with trace.span("expert compute", "compute"):
            return experts(rows, counts.tolist())


class AllToAllDispatcher:
    """The experts spread over the ranks of ``group``; ``experts`` holds this rank's share."""

    def __init__(self, num_experts: int, group: ProcessGroup | None = None):
        self.group, self.num_experts = group, num_experts
        self.world = dist.get_world_size(group)
        if num_experts % self.world:
            raise ValueError(f"num_experts={num_experts} is not divisible by the "
                             f"expert-parallel size {self.world}")
        self.local_experts = num_experts // self.world

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts) -> torch.Tensor:
        P, E_local = self.world, self.local_experts
        with trace.span("dispatch", "communication"):
            received_counts = exchange_counts(counts, self.group).view(P, E_local)
            send_splits = counts.view(P, E_local).sum(dim=1).tolist()
            recv_splits = received_counts.sum(dim=1).tolist()
            # before the call (NCCL hangs on disagreeing splits), on the rows' device
            check_splits(send_splits, recv_splits, self.group, device=rows.device)
            received = all_to_all(rows, recv_splits, send_splits, self.group, "dispatch")
        with trace.span("expert compute", "compute"):
            # received rows come grouped by source rank, then by local expert: regroup
            local_ids = torch.arange(E_local, device=rows.device).repeat(P).repeat_interleave(
                received_counts.reshape(-1))
            grouped, local_order, local_counts = sort_by_expert(received, local_ids, E_local)
            out = unsort(experts(grouped, local_counts.tolist()), local_order)
        with trace.span("combine", "communication"):
            return all_to_all(out, send_splits, recv_splits, self.group, "combine")
