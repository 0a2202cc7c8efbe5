"""FlashAttention as an autograd Function: forward saves q, k, v, the output and the
logsumexp L (..., N) — O(N d) bytes — and backward recomputes the scores tile by tile.

What it teaches (notebook 09_flash_attention): recomputation beats storage. Naive
attention saves the (..., N, N) probabilities for backward; FlashAttention saves only L,
one number per query row, from which any tile of P = exp(S - L) is rebuilt exactly
(Dao et al. 2022, section 3.1, "Recomputation"; Dao 2023, Algorithms 1 and 2).
``flash_attention_fn`` plugs it into the course GPT with ``minitrain.model.set_attention_fn``.
"""

from __future__ import annotations

import torch

from minitrain.flash_attention.tiles import (
    BLOCK_K,
    BLOCK_Q,
    flash_attention_backward,
    flash_attention_forward,
)


class FlashAttentionFunction(torch.autograd.Function):
    """``FlashAttentionFunction.apply(q, k, v, causal=False)`` on (..., N, D) tensors.

    Saved for backward (``ctx.saved_tensors``): q, k, v, the output and the logsumexp of the
    scaled scores, shape (..., Nq), fp32. Grouped-query attention: q (B, Hq, N, D) with k, v
    (B, Hkv, N, D), Hq a multiple of Hkv.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal=False, block_q=BLOCK_Q, block_k=BLOCK_K):
        out, lse = flash_attention_forward(q, k, v, bool(causal), block_q, block_k)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.blocks = bool(causal), (block_q, block_k)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(q, k, v, out, lse, grad_out.contiguous(),
                                              ctx.causal, *ctx.blocks)
        return dq, dk, dv, None, None, None


def flash_attention(q, k, v, causal: bool = False):
    """softmax(q k^T / sqrt(D)) v by tiles, differentiable; (..., N, D) in, (..., N, D) out."""
    return FlashAttentionFunction.apply(q, k, v, causal)


def flash_attention_fn(q, k, v, causal: bool = True, dropout_p: float = 0.0, training: bool = False):
    """The course GPT's ``attention_fn`` signature (see ``minitrain.model.naive_attention``):
    ``set_attention_fn(model, flash_attention_fn)``. Attention dropout is not implemented in
    the tiles (FlashAttention fuses it with a replayed RNG seed), so it is refused, not ignored."""
    if training and dropout_p > 0.0:
        raise ValueError(f"flash_attention_fn has no attention dropout; got dropout_p={dropout_p} "
                         f"in training (use a GPTConfig with dropout=0.0)")
    return flash_attention(q, k, v, causal)
