"""Dispatch by permutation: group the tokens by expert with one sort, and undo it
(chapter 8, notebook 08).

A mixture-of-experts layer must run each expert on *its* tokens. Looping over tokens in
Python would be hopeless; a mask per expert (``x[indices == e]``) reads every token E
times. Instead: one stable ``argsort`` of the expert ids puts the rows of each expert next
to each other (expert 0's first, then expert 1's, ...), ``bincount`` says how many each
has, each expert runs one matmul on its contiguous block, and the inverse permutation
puts the results back in token order. The same order is what expert parallelism needs:
the experts of a rank are consecutive, so the rows for each destination rank are
consecutive too, ready for ``all_to_all_single`` with uneven splits (Megatron-LM's
"permute / unpermute", Shoeybi et al. 2019, and GShard's dispatch, Lepikhin et al. 2020).
"""

from __future__ import annotations

import torch


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


def assignments(indices: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor):
    """Flatten a (T, k) routing into its kept assignments, token-major:
    ``(token, expert, weight)``, each (A,), A = number of kept assignments."""
    tokens = torch.arange(indices.shape[0], device=indices.device)
    tokens = tokens.unsqueeze(1).expand_as(indices)
    return tokens[keep], indices[keep], weights[keep]


def combine(expert_out: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor,
            num_tokens: int) -> torch.Tensor:
    """y_t = Σ over the kept assignments a of token t: weight_a · expert_out_a.

    A token with every choice dropped gets 0 (the block's residual carries it on).
    """
    weighted = expert_out * weights.unsqueeze(-1).to(expert_out.dtype)
    out = expert_out.new_zeros(num_tokens, expert_out.shape[-1])
    return out.index_add(0, tokens, weighted)
