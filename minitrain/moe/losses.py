"""The auxiliary losses of a mixture-of-experts router (chapter 8, notebook 08).

- ``load_balancing_loss``: Switch Transformer's N·Σ f_i·P_i (Fedus et al. 2021, section 2.2,
  equations 4–6), which is 1.0 when routing is perfectly uniform and grows to N when every
  token goes to one expert;
- ``router_z_loss``: ST-MoE's mean squared log-sum-exp of the router logits (Zoph et al.
  2022, section 3.1, equation 5), which keeps the logits small so the softmax stays
  numerically tame in low precision.

``AuxLossInBackward`` lets a layer carry its auxiliary loss on its output's backward (the
device of Megatron-LM's MoE "aux loss auto-scaler"): needed under activation checkpointing,
where the forward that the loss reads runs without a graph and only the recomputation in
backward builds one.

Both are computed per call on the tokens the router saw, so a rank of expert parallelism
computes exactly what the local layer computes for the same tokens. ``batch_load_balancing_loss``
counts f over the tokens of every rank of a group instead (the capstone: one process's loss).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def load_balancing_loss(router_probs: torch.Tensor, expert_indices: torch.Tensor,
                        num_experts: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss  N · Σ_i f_i · P_i  (Fedus et al. 2021, eq. 4).

    ``router_probs``: (T, N) softmax probabilities of each token over the N experts.
    ``expert_indices``: (T,) or (T, k) the experts each token was sent to (top-1 or top-k).
    f_i is the fraction of the T·k assignments that went to expert i (a count: no
    gradient flows through it), P_i the mean router probability of expert i over the T
    tokens (differentiable: the gradient pushes probability away from busy experts).
    Both sum to 1, so the loss is exactly 1.0 when both are uniform (1/N each), and N when
    every token and all probability go to one expert.

    Returns a 0-dim tensor in ``router_probs``' dtype that requires grad when
    ``router_probs`` does (the loss exists to train the router: never detach P).
    """
    if router_probs.dim() != 2 or router_probs.shape[1] != num_experts:
        raise ValueError(f"router_probs must be (tokens, {num_experts}), got "
                         f"{tuple(router_probs.shape)}")
    ### BEGIN SOLUTION
    flat = expert_indices.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts).to(router_probs.dtype)
    f = counts / max(flat.numel(), 1)
    p = router_probs.mean(dim=0)
    return num_experts * (f * p).sum()
    ### END SOLUTION


def batch_load_balancing_loss(router_probs: torch.Tensor, expert_indices: torch.Tensor,
                              num_experts: int, group=None) -> torch.Tensor:
    """This rank's term of the load-balancing loss of a batch spread over ``group``'s ranks.

    f_i is counted over the *whole* batch (an all-reduce of the counts: no gradient flows
    through f), P_i over this rank's tokens: N·Σ f_i·P_i. Every rank holding as many tokens,
    the mean of the ranks' terms is the loss of the whole batch on one process — what data,
    context and expert parallelism need to train exactly as one process (the capstone,
    chapter 11; Megatron-Core reduces the counts over its data-parallel ranks the same way).
    ``group=None`` outside a process group: ``load_balancing_loss`` on these tokens.
    """
    if group is None and not dist.is_initialized():
        return load_balancing_loss(router_probs, expert_indices, num_experts)
    flat = expert_indices.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts).to(router_probs.dtype)
    stats = torch.cat([counts, counts.new_full((1,), flat.numel())])  # one all-reduce
    dist.all_reduce(stats, group=group)
    f = stats[:-1] / stats[-1]
    return num_experts * (f * router_probs.mean(dim=0)).sum()


def router_z_loss(router_logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: mean over tokens of (log Σ_j exp(x_j))² (Zoph et al. 2022, eq. 5)."""
    return torch.logsumexp(router_logits, dim=-1).square().mean()


class AuxLossInBackward(torch.autograd.Function):
    """Identity on ``output``; in backward, also gives ``aux_loss`` the gradient ``scale``.

    So ``loss.backward()`` through the layer's output trains the router on ``scale · aux_loss``
    as if it had been added to the loss — including when the layer runs inside an activation
    checkpoint, whose first forward builds no graph. ``scale`` must be the weight of this
    forward's loss in the objective (1/M when M micro-batches' losses are averaged).
    """

    @staticmethod
    def forward(ctx, output, aux_loss, scale):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None
