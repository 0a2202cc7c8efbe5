"""ZeRO stage 1 as a drop-in optimizer: ``ShardedOptimizer``, and how parameters are split.

Chapter 5, notebooks/05_zero.ipynb.
Rajbhandari et al. 2020, §5.1 "P_os": each rank keeps the optimizer state of its share of
the parameters only, steps that share, and then the ranks exchange the updated values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from minitrain.zero.accounting import count_sent
from minitrain.zero.buffers import all_gather_tensor
from minitrain.zero.partition import partition_parameters


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1 as an optimizer: rank r keeps ``optimizer_cls`` state for its share only.

    The gradients must already be averaged over the ranks (use it under
    ``minitrain.ddp.DataParallel``, like torch's ZeroRedundancyOptimizer): DDP's all-reduce
    (2Ψ) plus this optimizer's all-gather (Ψ) send 3Ψ per step. ``ZeroDataParallel(stage=1)``
    does the averaging itself with a reduce-scatter and sends 2Ψ. ``state_dict()`` is this
    rank's shard (with the ownership, to check a resume uses the same world size).
    """

    def __init__(self, params, optimizer_cls, group: ProcessGroup | None = None, **kw):
        if not (
            isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)
        ):
            raise TypeError(
                f"optimizer_cls must be a torch.optim.Optimizer class, got {optimizer_cls!r}"
            )
        self.group, self.optimizer_cls = group, optimizer_cls
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.optimizer = None  # the local optimizer, over this rank's share
        super().__init__(params, kw)
        every = [p for g in self.param_groups for p in g["params"]]
        self.owned = partition_parameters([p.numel() for p in every], self.world_size)
        self._build_local()

    def _build_local(self):
        every = [p for g in self.param_groups for p in g["params"]]
        mine = {id(every[i]) for i in self.owned[self.rank]}
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [p for p in g["params"] if id(p) in mine],
            }
            for g in self.param_groups
        ]
        self.optimizer = self.optimizer_cls(groups)
        self.state = self.optimizer.state  # opt.state[p] works for the parameters this rank owns

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        if self.optimizer is None:  # still inside __init__
            return
        # new parameters go to ranks lightest-first, so old ownership (and state) stays put
        every = [p for g in self.param_groups for p in g["params"]]
        start = sum(len(o) for o in self.owned)
        loads = [sum(every[i].numel() for i in o) for o in self.owned]
        new = partition_parameters([p.numel() for p in every[start:]], self.world_size)
        new.sort(key=lambda o: -sum(every[start + i].numel() for i in o))
        for share, r in zip(new, sorted(range(self.world_size), key=lambda r: (loads[r], r))):
            self.owned[r] = sorted(self.owned[r] + [start + i for i in share])
        mine = {id(every[i]) for i in self.owned[self.rank] if i >= start}
        self.optimizer.add_param_group(
            {
                **{k: v for k, v in self.param_groups[-1].items() if k != "params"},
                "params": [p for p in self.param_groups[-1]["params"] if id(p) in mine],
            }
        )

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

    def state_dict(self):
        return {
            "world_size": self.world_size,
            "rank": self.rank,
            "owned": self.owned,
            "local": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state_dict):
        if state_dict.get("world_size") != self.world_size or state_dict.get("owned") != self.owned:
            raise ValueError(
                f"ShardedOptimizer.load_state_dict: the state was saved by rank "
                f"{state_dict.get('rank')} of world size {state_dict.get('world_size')} owning "
                f"{state_dict.get('owned')}; this is rank {self.rank} of {self.world_size} owning "
                f"{self.owned}"
            )
        self.optimizer.load_state_dict(state_dict["local"])
