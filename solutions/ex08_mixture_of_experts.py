"""Chapter 8 solutions — generated from minitrain.moe.router, minitrain.moe.dispatch, minitrain.moe.losses.

The worked answers. Look one up when you are stuck; the library has them too.
"""

from __future__ import annotations

import math
import torch
import torch.distributed as dist
from dataclasses import dataclass
from torch import nn
from minitrain.moe.experts import factory_kwargs
from minitrain.moe.losses import batch_load_balancing_loss, router_z_loss


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


def sort_by_expert(rows: torch.Tensor, expert_of_row: torch.Tensor, num_experts: int):
    """Permute ``rows`` so rows of the same expert are contiguous, in expert order.

    ``rows``: (A, d); ``expert_of_row``: (A,) integers in [0, num_experts).
    Returns ``(sorted_rows, order, counts)``: ``sorted_rows = rows[order]`` with ``order``
    a *stable* sort of ``expert_of_row`` (rows of one expert keep their relative order),
    and ``counts`` (num_experts,) the number of rows per expert (zeros included).
    Differentiable in ``rows``.
    """
    ### BEGIN SOLUTION
    order = torch.argsort(expert_of_row, stable=True)
    counts = torch.bincount(expert_of_row, minlength=num_experts)
    return rows[order], order, counts
    ### END SOLUTION


def unsort(sorted_rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The inverse of ``sort_by_expert``'s permutation: ``unsort(rows[order], order) == rows``.

    Row i of ``sorted_rows`` came from row ``order[i]``, so it goes back there.
    Differentiable in ``sorted_rows`` (its gradient is the forward permutation).
    """
    ### BEGIN SOLUTION
    out = sorted_rows.new_zeros(sorted_rows.shape)
    return out.index_copy(0, order, sorted_rows)
    ### END SOLUTION


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

# minitrain-exercises-hash: e85ae2f6fd1e1458
