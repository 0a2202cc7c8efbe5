"""Merging partial attention results by their logsumexp: the step ring attention repeats.

Used by notebooks/10_context_parallel.ipynb (and exercise ``merge_attention``).
Attention of a query over keys A ∪ B is a softmax-weighted average. Computed over A alone
it gives an output o_A and the log of its softmax denominator, lse_A = log Σ_{j∈A} e^{s_j};
over B, o_B and lse_B. The softmax over A ∪ B has denominator e^{lse_A} + e^{lse_B}, and
the output is the two partial outputs re-weighted by their share of it:

    lse = log(e^{lse_A} + e^{lse_B})
    o   = o_A · e^{lse_A − lse} + o_B · e^{lse_B − lse}

This is FlashAttention's online softmax (Dao et al. 2022, section 3.1; Milakov & Gimelshein
2018) applied to whole blocks, and what lets ring attention (Liu et al. 2023) compute one
key/value block at a time as the blocks arrive from other ranks.
"""

from __future__ import annotations

import torch


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Combine two partial attention results of the same queries over disjoint key sets.

    ``out_*`` have shape ``(..., n, d)``, ``lse_*`` shape ``(..., n)`` (the logsumexp of
    each query's scores over that key set; ``-inf`` where the set was empty for the
    query). Returns ``(out, lse)``: attention over the union, and its logsumexp.

    Scores can be large (lse of 1000 is ordinary with unscaled logits): ``e^{lse}``
    overflows float32 above 88, so work with ``e^{lse_x − m}``, m = max(lse_a, lse_b),
    never with ``e^{lse_x}`` itself. Where both are ``-inf`` the result is out = 0,
    lse = -inf (a query that has seen no key yet). ``out`` keeps ``out_a``'s dtype, ``lse``
    its own.

    Requirements and why: merging A with B or B with A gives the same result (ring attention
    merges blocks in whatever order they arrive); ``lse`` is the union's, so the next merge
    can weigh this result against the next block.
    """
    ### BEGIN SOLUTION
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # both -inf: keep exp finite
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    lse = m + torch.log(total)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out = (out_a * w_a.unsqueeze(-1) + out_b * w_b.unsqueeze(-1)) / safe.unsqueeze(-1)
    return out.to(out_a.dtype), lse
    ### END SOLUTION
