"""Chapter 9 solutions — generated from minitrain.flash_attention.tiles.

The worked answers. Look one up when you are stuck; the library has them too.
"""

from __future__ import annotations

import math
import torch
from minitrain.flash_attention.tile_grid import blocks, causal_mask, visible_key_blocks
from minitrain.flash_attention.tiles import BLOCK_K, tile_matmul


def online_softmax_update(m, row_sum, acc, s, v):
    """Fold one tile of scores into the running softmax of its rows (Dao 2023, Alg. 1 l. 8-10).

    m, row_sum: (..., bq) running max and running sum of exp(score - m); acc: (..., bq, D) the
    running sum of exp(score - m) @ v, all in the accumulation dtype (fp32, fp64 for fp64
    inputs); s: (..., bq, bk) this tile's scaled scores (in that dtype, masked entries -inf);
    v: (..., bk, D) in the inputs' dtype (bf16 in notebook 09's check, while s and the
    state are fp32). Returns the new (m, row_sum, acc), in the accumulation dtype.

    Requirements and why: every sum so far is relative to the old running max, so when the
    max grows they must be rescaled before this tile is added (else the earlier tiles count
    e^(m_new - m_old) times too much); the product of the probabilities with ``v`` is
    accumulated in the accumulation dtype, never rounded to ``v``'s bf16 (``tile_matmul``;
    the probabilities may be rounded to ``v``'s dtype first, as a tensor core's bf16 operand
    is); masked scores (-inf) must count for nothing.
    """
    ### BEGIN SOLUTION
    m_new = torch.maximum(m, s.amax(dim=-1))
    p = torch.exp(s - m_new[..., None])
    alpha = torch.exp(m - m_new)  # exp(-inf) = 0 on the first tile: nothing to rescale yet
    sum_new = alpha * row_sum + p.sum(dim=-1)
    acc_new = alpha[..., None] * acc + tile_matmul(p.to(v.dtype), v, acc.dtype)
    return m_new, sum_new, acc_new
    ### END SOLUTION


def forward_query_block(q_i, k, v, i0: int, causal: bool, block_k: int = BLOCK_K, log=None):
    """One query block's output and logsumexp: loop over key blocks (FA-2's inner loop; on a
    GPU one program per query block runs this). q_i: (..., bq, D) starting at row i0;
    k, v: (..., Nk, D). Returns out_i (..., bq, D) and lse_i (..., bq) in the accumulation
    dtype ``torch.promote_types(q_i.dtype, torch.float32)`` (fp32; fp64 for fp64 inputs).

    Start from m = -inf, row_sum = 0, acc = 0 (in that dtype); for each visible key block
    compute the scaled scores q_i k_j^T / sqrt(D), accumulated in that dtype from the
    16-bit inputs (``tile_matmul``: never rounded to bf16 first), put -inf where
    ``causal_mask`` says, fold them in with ``online_softmax_update``; at the end
    out_i = acc / row_sum and lse_i = m + log(row_sum).
    """
    scale = 1.0 / math.sqrt(q_i.shape[-1])
    i1 = i0 + q_i.shape[-2]
    acc_dtype = torch.promote_types(q_i.dtype, torch.float32)  # bf16/fp16 -> fp32, fp64 stays
    ### BEGIN SOLUTION
    m = torch.full(q_i.shape[:-1], -math.inf, dtype=acc_dtype, device=q_i.device)
    row_sum = torch.zeros(q_i.shape[:-1], dtype=acc_dtype, device=q_i.device)
    acc = torch.zeros(q_i.shape, dtype=acc_dtype, device=q_i.device)
    for j0, j1 in visible_key_blocks(i0, i1, k, block_k, causal, log):
        k_j, v_j = k[..., j0:j1, :], v[..., j0:j1, :]
        s = tile_matmul(q_i, k_j.transpose(-2, -1), acc_dtype) * scale
        mask = causal_mask(i0, i1, j0, j1, q_i.device) if causal else None
        if mask is not None:
            s = s.masked_fill(mask, -math.inf)
        m, row_sum, acc = online_softmax_update(m, row_sum, acc, s, v_j)
    return acc / row_sum[..., None], m + torch.log(row_sum)
    ### END SOLUTION


def block_backward(q_i, k_j, v_j, do_i, lse_i, delta_i, mask=None):
    """Gradient contributions of one (query block i, key block j) tile (Dao 2023, Alg. 2
    lines 11-16), recomputing the probabilities from the saved logsumexp:

        P = exp(q_i k_j^T / sqrt(D) - L_i)     (0 where ``mask`` is True)
        dV_j = P^T dO_i,   dP = dO_i V_j^T,   dS = P * (dP - D_i)
        dQ_i = dS k_j / sqrt(D),   dK_j = dS^T q_i / sqrt(D)

    with D_i = rowsum(dO_i * O_i) (``delta_i``). Returns (dq_i, dk_j, dv_j) in the accumulation
    dtype ``torch.promote_types(q_i.dtype, torch.float32)`` (fp32; fp64 for fp64 inputs), shaped
    like q_i, k_j, v_j broadcast against each other (a GQA group's heads not yet summed). Every
    product is accumulated in that dtype, never rounded to the inputs' bf16 (``tile_matmul``):
    the scores and dP exactly from the 16-bit inputs; P and dS may be rounded to the inputs'
    dtype as operands (a tensor core's bf16 operands, as here and in the Triton kernel).
    """
    scale = 1.0 / math.sqrt(q_i.shape[-1])
    acc_dtype = torch.promote_types(q_i.dtype, torch.float32)  # bf16/fp16 -> fp32, fp64 stays
    ### BEGIN SOLUTION
    s = tile_matmul(q_i, k_j.transpose(-2, -1), acc_dtype) * scale
    p = torch.exp(s - lse_i[..., None])
    if mask is not None:
        p = p.masked_fill(mask, 0.0)
    dv_j = tile_matmul(p.to(do_i.dtype).transpose(-2, -1), do_i, acc_dtype)
    dp = tile_matmul(do_i, v_j.transpose(-2, -1), acc_dtype)
    ds = p * (dp - delta_i[..., None])
    dq_i = tile_matmul(ds.to(k_j.dtype), k_j, acc_dtype) * scale
    dk_j = tile_matmul(ds.to(q_i.dtype).transpose(-2, -1), q_i, acc_dtype) * scale
    return dq_i, dk_j, dv_j
    ### END SOLUTION

# minitrain-exercises-hash: 1ee47158bf34256b
