"""``MoELayer``: a router, E experts, dispatch by permutation and a weighted combine
(chapter 8, notebook 08).

Shazeer et al. 2017 (sparsely-gated mixture of experts), with Switch's top-1 and capacity
(Fedus et al. 2021) and GShard's top-2 (Lepikhin et al. 2020). For T tokens:

    route:    indices, weights, keep = router(x)                 (T, k) each
    sort:     rows of the kept assignments, sorted by expert      (A, d), A ≤ T·k
    dispatch: the experts' outputs for those rows, wherever the experts live
              (``dispatchers.py``: here, or over an all-to-all for expert parallelism)
    combine:  un-sort, y_t = Σ_kept weight · expert output        (T, d)

A dropped token's output is 0, so in a block x + moe(ln(x)) it passes through the
residual unchanged. The layer takes (tokens, d_model) — or any (..., d_model), flattened —
so it can stand in for the GPT's MLP (``apply.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from minitrain.moe.dispatch import assignments, combine, sort_by_expert, unsort
from minitrain.moe.dispatchers import LocalDispatcher
from minitrain.moe.experts import Experts
from minitrain.moe.losses import AuxLossInBackward
from minitrain.moe.router import TopKRouter
from minitrain.runtime import trace


class MoELayer(nn.Module):
    """A mixture-of-experts feed-forward layer: a router, experts and a dispatcher.

    ``capacity_factor=None`` drops nothing. ``router``, ``experts``, ``dispatcher`` (keyword
    only): parts to use instead of new ones — ``ExpertParallelMoE.from_local`` builds the
    layer from a local one's router, a share of its experts and an ``AllToAllDispatcher``. Extra keywords go to ``TopKRouter``
    (``balancing``, ``aux_loss_weight``, ``z_loss_weight``, ``bias_update_rate``);
    ``device``/``dtype`` place new parts as torch modules do (default: ``get_device()``);
    the caller passes tokens on that device (issue 41).
    After a forward: ``aux_loss`` (the router's weighted auxiliary losses: the caller adds
    it to the loss) and ``last_routing`` (``router.Routing``: indices, weights, keep, probs,
    load). With ``aux_loss_in_backward = True`` (set by ``apply_moe``) the aux loss instead
    rides on the output's backward, times ``aux_loss_scale`` (``losses.AuxLossInBackward``),
    which survives activation checkpointing.
    """

    aux_loss_in_backward = False
    aux_loss_scale = 1.0

    def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int = 1,
                 capacity_factor: float | None = None, *, router: TopKRouter | None = None,
                 experts: Experts | None = None, dispatcher=None, device=None, dtype=None,
                 **router_kwargs):
        super().__init__()
        self.d_model, self.d_ff, self.num_experts, self.top_k = d_model, d_ff, num_experts, top_k
        # new parts are built on ``device`` (get_device() unless told: issue 29)
        self.router = router or TopKRouter(d_model, num_experts, top_k, capacity_factor,
                                           device=device, dtype=dtype, **router_kwargs)
        self.experts = experts or Experts(num_experts, d_model, d_ff, device=device, dtype=dtype)
        self.dispatcher = dispatcher or LocalDispatcher()
        self.last_routing = None

    @property
    def aux_loss(self) -> torch.Tensor:
        return self.router.aux_loss

    def __getstate__(self):  # copy.deepcopy after a forward: leave its graph behind
        return {**self.__dict__, "last_routing": None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.d_model:
            raise ValueError(f"MoELayer expects (..., {self.d_model}), got {tuple(x.shape)}")
        lead, x = x.shape[:-1], x.reshape(-1, self.d_model)
        with trace.span("route", "compute"):
            routing = self.router(x)
            tokens, experts, weights = assignments(routing.indices, routing.weights, routing.keep)
            # sorted by global expert = grouped by the rank holding it (experts are contiguous)
            rows, order, counts = sort_by_expert(x[tokens], experts, self.num_experts)
        out = self.dispatcher(rows, counts, self.experts)
        with trace.span("combine", "compute"):
            y = combine(unsort(out, order), tokens, weights, x.shape[0])
        self.last_routing = routing
        return self.attach_aux_loss(y).reshape(*lead, self.d_model)

    def attach_aux_loss(self, y: torch.Tensor) -> torch.Tensor:
        if self.aux_loss_in_backward and torch.is_grad_enabled() and self.aux_loss.requires_grad:
            return AuxLossInBackward.apply(y, self.aux_loss, self.aux_loss_scale)
        return y

    def num_parameters(self) -> tuple[int, int]:
        """(all parameters, parameters one token uses: the router and k experts)."""
        total = sum(p.numel() for p in self.parameters())
        active = self.router.gate.weight.numel() + self.top_k * self.experts.params_per_expert()
        return total, active
