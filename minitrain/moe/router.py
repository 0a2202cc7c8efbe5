"""The router of a mixture-of-experts layer: which experts each token goes to (chapter 8,
notebook 08).

A linear gate scores every token against every expert; a softmax makes the scores
probabilities; each token picks its ``top_k`` experts (k = 1: Switch Transformer, Fedus et
al. 2021; k = 2: GShard, Lepikhin et al. 2020) and its output is their outputs weighted by
the chosen probabilities renormalised to sum to 1 — except at k = 1, where Switch gates by
the raw probability (renormalised it would be 1, and the task loss could not train the
router). Each expert takes at most

    capacity = ⌈capacity_factor · k · T / E⌉     (Fedus et al. 2021, section 2.1, eq. 3)

of the T·k assignments of a batch; the rest are *dropped*: that choice contributes nothing
and, with every choice dropped, the token passes through the block's residual alone.

Two ways to balance the load are built here: the auxiliary loss (``losses.py``), and
DeepSeek-V3's auxiliary-loss-free method (DeepSeek-AI 2024, section 2.1.2): a per-expert
bias added to the scores *only to choose* the experts, nudged after each step by a fixed
rate γ down for overloaded experts and up for underloaded ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from minitrain.moe.experts import factory_kwargs
from minitrain.moe.losses import batch_load_balancing_loss, load_balancing_loss, router_z_loss

BALANCING = ("aux_loss", "bias", "none")


def expert_capacity(num_tokens: int, num_experts: int, top_k: int,
                    capacity_factor: float | None) -> int:
    """⌈capacity_factor · k · T / E⌉ assignments per expert; no limit (T·k) when None."""
    if capacity_factor is None:
        return num_tokens * top_k
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
    return math.ceil(capacity_factor * top_k * num_tokens / num_experts)


def top_k_routing(probs: torch.Tensor, top_k: int, capacity: int,
                  selection_bias: torch.Tensor | None = None):
    """Choose ``top_k`` experts per token, renormalise their weights, drop over capacity.

    ``probs``: (T, E) router probabilities. ``selection_bias``: (E,) added to the scores
    only to *choose* (DeepSeek-V3); the weights are always the probabilities themselves.
    Returns ``(indices, weights, keep)``, each (T, k): the chosen experts (best first), their
    probabilities divided by the sum of the k chosen ones, and whether the assignment fits
    in its expert's capacity. Priority within an expert (GShard, Lepikhin et al. 2020,
    Algorithm 1): every token's first choice before any second choice, and within one
    choice rank the earlier token first — so the *last* tokens of a batch are dropped.
    """
    ### BEGIN SOLUTION
    scores = probs if selection_bias is None else probs + selection_bias
    indices = torch.topk(scores, top_k, dim=-1).indices  # (T, k)
    chosen = probs.gather(-1, indices)
    weights = chosen / chosen.sum(dim=-1, keepdim=True)
    one_hot = torch.nn.functional.one_hot(indices.t(), probs.shape[-1])  # (k, T, E)
    position = (one_hot.reshape(-1, probs.shape[-1]).cumsum(dim=0) - 1).reshape(one_hot.shape)
    slot = (position * one_hot).sum(dim=-1).t()  # (T, k): place in the chosen expert's queue
    keep = slot < capacity
    return indices, weights, keep
    ### END SOLUTION


@dataclass
class Routing:
    """What the router decided for T tokens (every tensor (T, k) unless said)."""

    indices: torch.Tensor
    weights: torch.Tensor
    keep: torch.Tensor
    probs: torch.Tensor  # (T, E)
    logits: torch.Tensor  # (T, E)
    capacity: int

    @property
    def load(self) -> torch.Tensor:
        """(E,) assignments each expert *received* (after dropping)."""
        return torch.bincount(self.indices[self.keep], minlength=self.probs.shape[-1])

    @property
    def dropped_fraction(self) -> float:
        return 1.0 - self.keep.float().mean().item()


class TopKRouter(nn.Module):
    """Softmax gate + top-k + capacity + the balancing losses or bias.

    ``balancing``: ``"aux_loss"`` (Switch's loss times ``aux_loss_weight``), ``"bias"``
    (DeepSeek-V3's selection bias, updated by ``update_bias`` at rate ``bias_update_rate``)
    or ``"none"``. ``z_loss_weight`` adds ST-MoE's z-loss in every mode. After a forward,
    ``aux_loss`` holds this call's weighted auxiliary loss (a tensor, part of the graph).
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int = 1,
                 capacity_factor: float | None = None, balancing: str = "aux_loss",
                 aux_loss_weight: float = 0.01, z_loss_weight: float = 0.0,
                 bias_update_rate: float = 1e-3, device=None, dtype=None):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
        if balancing not in BALANCING:
            raise ValueError(f"balancing {balancing!r} is not one of {BALANCING}")
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.balancing, self.aux_loss_weight = balancing, aux_loss_weight
        self.z_loss_weight, self.bias_update_rate = z_loss_weight, bias_update_rate
        # built where it will live (get_device() unless told, as the experts: issue 29)
        self.gate = nn.Linear(d_model, num_experts, bias=False, **factory_kwargs(device, dtype))
        here = self.gate.weight.device
        # a buffer, not a parameter: the bias is set by a rule, not by gradient descent
        self.register_buffer("expert_bias", torch.zeros(num_experts, device=here))
        self.register_buffer("observed_load", torch.zeros(num_experts, device=here))
        self.aux_loss = torch.zeros((), device=here)
        self.balance_loss = torch.zeros((), device=here)  # the last forward's N·Σ f·P, unweighted
        # set by the capstone (chapter 11): the ranks whose tokens form one batch, over which
        # the load-balancing loss counts f (``losses.batch_load_balancing_loss``)
        self.token_group = None

    def __getstate__(self):
        # the last forward's aux loss is part of a graph (not copyable): copies start afresh;
        # a process group cannot be copied either (set it again on the copy)
        # (on the gate's device: a copy made under any default device keeps it, issue 29)
        return {**self.__dict__, "aux_loss": torch.zeros((), device=self.gate.weight.device),
                "token_group": None}

    def forward(self, x: torch.Tensor) -> Routing:
        # routing in fp32 (Fedus et al. 2021, section 2.4) or wider: fp64 stays fp64
        logits = self.gate(x)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        probs = torch.softmax(logits, dim=-1)
        capacity = expert_capacity(x.shape[0], self.num_experts, self.top_k,
                                   self.capacity_factor)
        bias = self.expert_bias if self.balancing == "bias" else None
        indices, weights, keep = top_k_routing(probs, self.top_k, capacity, bias)
        if self.top_k == 1:
            # Switch (Fedus et al. 2021, eq. 2: y = p_i(x)·E_i(x)) gates by the raw probability:
            # renormalised it would be p/p = 1, a constant, and the task loss would give the
            # router no gradient at all (only the aux loss would train it). Top-k > 1 keeps
            # the renormalised weights (GShard; Mixtral, Jiang et al. 2024): their ratios
            # still depend on the logits, so the task loss trains the router through them.
            weights = probs.gather(-1, indices)
        routing = Routing(indices, weights, keep, probs, logits, capacity)
        aux = logits.new_zeros(())
        if self.balancing == "aux_loss":
            if self.token_group is None:
                balance = load_balancing_loss(probs, indices, self.num_experts)
            else:  # f counted over every rank's tokens (chapter 11: equal to one process)
                balance = batch_load_balancing_loss(probs, indices, self.num_experts,
                                                    self.token_group)
            self.balance_loss = balance.detach()  # unweighted, for logs
            if self.aux_loss_weight:
                aux = aux + self.aux_loss_weight * balance
        if self.z_loss_weight:
            aux = aux + self.z_loss_weight * router_z_loss(logits)
        self.aux_loss = aux
        if self.training and self.balancing == "bias":  # its only reader: update_bias
            # counted before dropping: the bias should see the demand, not what fitted (in
            # other modes nothing resets it: it would grow for ever, past fp32's exact counts)
            self.observed_load += torch.bincount(indices.reshape(-1),
                                                 minlength=self.num_experts).float()
        return routing

    # Activation checkpointing (chapter 3) runs this forward again in backward: it puts this
    # state back as the forward found it for the recompute and the live one after, so the
    # recompute chooses with the forward's bias and its load is not counted a second time.
    def get_state(self) -> dict:
        """What a forward reads and updates besides the parameters: the selection bias and the
        load counted since the last ``update_bias``."""
        return {"expert_bias": self.expert_bias.clone(),
                "observed_load": self.observed_load.clone()}

    @torch.no_grad()
    def set_state(self, state: dict) -> None:
        self.expert_bias.copy_(state["expert_bias"])
        self.observed_load.copy_(state["observed_load"])

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor | None = None) -> None:
        """DeepSeek-V3's update: b_i -= γ·sign(load_i − mean load); then forget the load.

        ``load`` defaults to the assignments counted since the last update (expert
        parallelism passes the sum over its ranks, so every rank's bias stays the same).
        """
        load = self.observed_load if load is None else load
        self.expert_bias -= self.bias_update_rate * torch.sign(load - load.mean())
        self.observed_load.zero_()
