"""FlashAttention-2 in PyTorch tiles: online softmax forward, recomputing backward.

What it teaches (notebook 09_flash_attention): attention computed one (query block, key
block) tile at a time, so the N x N score matrix never exists — only tiles of it, "in
SRAM" — and backward recomputes the tiles from q, k, v and the saved logsumexp L instead
of storing the probabilities. Dao 2023 (FlashAttention-2), Algorithm 1 (forward) and
Algorithm 2 (backward); Dao et al. 2022 (FlashAttention), section 3.1 for the online
softmax and recomputation; Milakov & Gimelshein 2018 for the running max and sum.

Shapes: q (..., Nq, D), k and v (..., Nk, D). Grouped-query attention (Ainslie et al.
2023): with q (B, Hq, N, D) and k, v (B, Hkv, N, D), each group of Hq / Hkv query heads
shares one k/v head — done by broadcasting, never by copying k and v.

Precision: scores, the running max/sum and the accumulators are in
``torch.promote_types(dtype, torch.float32)``: fp32 for bf16/fp16/fp32 inputs (as the CUDA
kernels keep them in fp32 registers), fp64 for fp64 inputs (never silently fp32). Every tile
matmul (S = q k^T, P V, dP = dO V^T, dS K, dS^T Q, P^T dO) takes operands with 16-bit values
(P and dS rounded to the inputs' dtype) and accumulates in that dtype (``tile_matmul``), as
FlashAttention-2's kernels (Dao 2023) and ``triton_kernels.py``'s ``tl.dot`` do on tensor
cores; outputs and gradients are returned in the inputs' dtype.
``scaled_dot_product_attention`` is the tests' oracle and is never called here.

Public: ``flash_attention_forward(q, k, v, causal) -> (out, lse)`` and
``flash_attention_backward(q, k, v, out, lse, grad_out, causal) -> (dq, dk, dv)``. The
backward uses D = rowsum(dO * O) of the ``out`` it is given, so with the *global* output
and logsumexp of a larger attention it returns one key block's exact contribution (what
ring attention, chapter 10, needs).
"""

from __future__ import annotations

import math

import torch

# the tile grid lives in its own module so the fused path (fused_tiles.py) shares it without
# importing this one; re-exported here, where the exercises and the widget find it
from minitrain.flash_attention.tile_grid import blocks, causal_mask, visible_key_blocks

__all__ = ["BLOCK_K", "BLOCK_Q", "TileLog", "blocks", "causal_mask", "visible_key_blocks",
           "tile_matmul", "online_softmax_update", "forward_query_block", "block_backward",
           "group_heads", "flash_attention_forward", "flash_attention_backward"]

BLOCK_Q = 128  # query rows per tile (B_r in the paper)
BLOCK_K = 128  # key rows per tile (B_c)


class TileLog:
    """What the tiled code records as it runs: elements read from / written to "HBM"
    (the full tensors) into "SRAM" (a tile), tiles computed and tiles skipped, FLOPs of
    the matmuls. ``minitrain.flash_attention.io_model`` checks these against its formulas.
    """

    def __init__(self):
        self.reads = self.writes = self.flops = 0
        self.tiles = self.skipped = self.skipped_flops = 0

    def read(self, *tensors):
        self.reads += sum(t.numel() for t in tensors)

    def write(self, *tensors):
        self.writes += sum(t.numel() for t in tensors)


def tile_matmul(a, b, acc_dtype):
    """``a @ b`` accumulated and returned in ``acc_dtype`` (fp32 for bf16/fp16 operands, fp64
    for fp64): what a tensor core and Triton's ``tl.dot`` do with 16-bit operands, products
    summed in fp32 (Micikevicius et al. 2018, section 3.3; FlashAttention-2, Dao 2023).

    Why cast first: a PyTorch matmul of two bf16 tensors returns bf16, rounding every score to
    8 bits before the fp32 softmax (issue 40: 2-4x the error against fp64). A product of two
    bf16 (fp16) values has at most 16 (22) significant bits, exact in fp32's 24, so the casts
    lose nothing; fp32 and fp64 operands pass through uncopied."""
    return a.to(acc_dtype) @ b.to(acc_dtype)


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


def _fused(acc_dtype, *tensors) -> bool:
    """Whether the fused tiles (fused_tiles.py) run: inputs already in their accumulation
    dtype (fp32, fp64), so no tile needs a cast; bf16/fp16 take the readable path below."""
    return all(t.dtype == acc_dtype for t in tensors)


def group_heads(q, k, v):
    """Views for grouped-query attention: q (..., Hq, N, D) -> (..., Hkv, G, N, D) and
    k, v (..., Hkv, N, D) -> (..., Hkv, 1, N, D), so one k/v head broadcasts over its G
    query heads. Equal shapes (or 2-D/3-D inputs with equal leading dims) pass through."""
    if q.dim() < 2 or k.shape[:-2] != v.shape[:-2] or k.shape[-1] != q.shape[-1] or v.shape[-2] != k.shape[-2]:
        raise ValueError(f"attention needs q (..., Nq, D), k and v (..., Nk, D) with the same D "
                         f"and leading dims; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[:-2] == k.shape[:-2]:
        return q, k, v, 0
    hq, hkv = q.shape[-3], k.shape[-3]
    if q.dim() < 3 or q.shape[:-3] != k.shape[:-3] or hq % hkv:
        raise ValueError(f"grouped-query attention needs q (..., Hq, N, D) and k, v (..., Hkv, N, D) "
                         f"with Hkv dividing Hq; got q {tuple(q.shape)} and k {tuple(k.shape)}")
    g = hq // hkv
    q = q.reshape(*q.shape[:-3], hkv, g, *q.shape[-2:])
    return q, k.unsqueeze(-3), v.unsqueeze(-3), g


def flash_attention_forward(q, k, v, causal: bool = False, block_q: int = BLOCK_Q,
                            block_k: int = BLOCK_K, log: TileLog | None = None):
    """Tiled attention forward: ``(out, lse)``, out like q (q's dtype), lse (..., Nq) in
    ``torch.promote_types(q.dtype, torch.float32)`` (fp32; fp64 for fp64 inputs).

    Outer loop over query blocks (each independent: one GPU program each), reading q_i once
    and writing out_i and lse_i once; the inner loop ``forward_query_block``. q and k may
    have different lengths; ``causal`` lets query i see keys j <= i.
    """
    qg, kg, vg, groups = group_heads(q, k, v)
    acc = torch.promote_types(q.dtype, torch.float32)  # bf16/fp16 -> fp32, fp64 stays fp64
    if _fused(acc, q, k, v):  # the same tiles with fewer ops each (fused_tiles.py)
        # imported here, not above: the exercises' generated imports list this module's, and
        # the fused tiles are not a helper for them
        from minitrain.flash_attention.fused_tiles import fused_forward

        out, lse = fused_forward(qg, kg, vg, groups, causal, block_q, block_k, log)
        return out.reshape(q.shape), lse.reshape(q.shape[:-1])
    out = torch.empty(qg.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(qg.shape[:-1], dtype=acc, device=q.device)
    for i0, i1 in blocks(q.shape[-2], block_q):
        q_i = qg[..., i0:i1, :]
        o_i, lse_i = forward_query_block(q_i, kg, vg, i0, causal, block_k, log)
        out[..., i0:i1, :], lse[..., i0:i1] = o_i, lse_i
        if log is not None:
            log.read(q_i)
            log.write(out[..., i0:i1, :], lse[..., i0:i1])
    return out.reshape(q.shape), lse.reshape(q.shape[:-1])


def flash_attention_backward(q, k, v, out, lse, grad_out, causal: bool = False,
                             block_q: int = BLOCK_Q, block_k: int = BLOCK_K,
                             log: TileLog | None = None):
    """Tiled attention backward (Dao 2023, Algorithm 2): ``(dq, dk, dv)`` in the inputs' dtypes.

    D = rowsum(dO * O) is computed from ``out`` as given — the global output when this is
    one block of a larger attention (ring attention), so the result is that block's exact
    contribution. Outer loop over key blocks: dK_j and dV_j accumulate in "SRAM" and are
    written once; dQ_i is read-modified-written per tile in an fp32 buffer (on a GPU: atomic
    adds, or a second pass by query block as minitrain's Triton kernel does). Accumulators
    are ``torch.promote_types(q.dtype, torch.float32)``: fp32, fp64 for fp64 inputs.
    """
    qg, kg, vg, groups = group_heads(q, k, v)
    acc = torch.promote_types(q.dtype, torch.float32)  # bf16/fp16 -> fp32, fp64 stays fp64
    do, o = grad_out.reshape(qg.shape), out.reshape(qg.shape)
    lse = lse.reshape(qg.shape[:-1]).to(acc)
    if _fused(acc, q, k, v, grad_out, out):  # the same tiles with fewer ops each
        from minitrain.flash_attention.fused_tiles import fused_backward  # (see the forward)

        dq, dk, dv = fused_backward(qg, kg, vg, do, o, lse, groups, causal, block_q, block_k, log)
        return dq.reshape(q.shape), dk.view(k.shape), dv.view(v.shape)
    delta = (do.to(acc) * o.to(acc)).sum(dim=-1)  # D_i = rowsum(dO_i * O_i)
    dq = torch.zeros(qg.shape, dtype=acc, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    nq, nk = q.shape[-2], k.shape[-2]
    for j0, j1 in blocks(nk, block_k):
        k_j, v_j = kg[..., j0:j1, :], vg[..., j0:j1, :]
        # fp32 (fp64) accumulators, one per query head (summed over a GQA group at the end)
        dk_j = torch.zeros(*qg.shape[:-2], j1 - j0, k.shape[-1], dtype=acc, device=q.device)
        dv_j = torch.zeros_like(dk_j)
        for i0, i1 in blocks(nq, block_q):
            if causal and j0 > i1 - 1:  # fully masked tile: nothing flows back through it
                if log is not None:
                    log.skipped += 1
                continue
            mask = causal_mask(i0, i1, j0, j1, q.device) if causal else None
            dq_i, dk_c, dv_c = block_backward(qg[..., i0:i1, :], k_j, v_j, do[..., i0:i1, :],
                                              lse[..., i0:i1], delta[..., i0:i1], mask)
            dq[..., i0:i1, :] += dq_i
            dk_j += dk_c
            dv_j += dv_c
            if log is not None:
                log.tiles += 1
        if groups:  # a k/v head's gradient is the sum over the query heads sharing it
            dk_j, dv_j = dk_j.sum(dim=-3), dv_j.sum(dim=-3)
        dk[..., j0:j1, :], dv[..., j0:j1, :] = dk_j, dv_j
    return dq.reshape(q.shape).to(q.dtype), dk, dv
