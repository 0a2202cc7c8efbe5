"""FlashAttention-2's tiles with few, fused ops per tile: the fast path of ``tiles.py``.

Used by ``flash_attention_forward`` / ``flash_attention_backward`` (tiles.py) for inputs
already in their accumulation dtype (fp32, fp64), so by ``flash_attention`` (notebook
09_flash_attention), ring attention (chapter 10) and ``python -m minitrain.bench flash``.
The readable path (``forward_query_block``, ``online_softmax_update``, ``block_backward``,
chapter 9's exercises) computes the same tiles in the same order; this file only spends
fewer PyTorch ops on each. Issue 33's profile of the readable path (N = 2048): hundreds of
small ops per call — exp, multiply, subtract, casts, masks rebuilt per tile, ~22 % — and
Python work per tile, where SDPA runs two fused kernels. Here:

* the scale 1/sqrt(D) is folded into a scaled copy of each query block, made once;
* scores are made by ``bmm`` / ``baddbmm`` straight into the form the next step needs
  (backward: ``baddbmm(-L, q, k^T)`` gives s - L in one op, ``baddbmm(-D, dO, v^T)`` gives
  dP - D), then ``exp_`` and the rescales work in place;
* the online softmax rescales its running sum and accumulator once per tile, in place
  (``mul_``), and divides by the sum once per row block at the end (Dao 2023, Alg. 1 l. 12);
* causal masks are built once per (row offset, tile shape), not per tile;
* a GQA group's G query heads are stacked as rows of one matrix per k/v head, so a tile is
  one ``bmm`` against the unexpanded k/v head and dK, dV sum over the group inside the
  matmul (Ainslie et al. 2023); k and v are never copied per head.

The tile loops and the ``TileLog`` records are the readable path's (``visible_key_blocks``),
so ``io_model`` counts what runs here.
"""

from __future__ import annotations

import math

import torch

from minitrain.flash_attention.tile_grid import blocks, causal_mask, visible_key_blocks


def _as_batches(qg, kg, vg, groups: int):
    """3-D views: q (Bt, G, Nq, D), k and v (Bt, Nk, D); Bt = the k/v heads (and batch)."""
    g = max(groups, 1)
    nq, nk, d = qg.shape[-2], kg.shape[-2], qg.shape[-1]
    return qg.reshape(-1, g, nq, d), kg.reshape(-1, nk, d), vg.reshape(-1, nk, d), g


def _rows(t4, i0: int, i1: int, scale: float | None = None):
    """Rows i0..i1 of every group head of t4 (Bt, G, N, ...) stacked: (Bt, G·(i1-i0), ...),
    contiguous (times ``scale`` if given, in the same pass). Without ``scale`` it may be a view
    of the caller's tensor (one block, already contiguous): never modify it in place."""
    part = t4[:, :, i0:i1]
    flat = part.mul(scale) if scale is not None else part.contiguous()
    return flat.reshape(t4.shape[0], -1, *t4.shape[3:])


class _Masks:
    """Causal masks by (i0 - j0, rows, cols): a tile's mask depends only on these."""

    def __init__(self, device):
        self.device, self.cache = device, {}

    def get(self, i0: int, i1: int, j0: int, j1: int):
        key = (i0 - j0, i1 - i0, j1 - j0)
        if key not in self.cache:
            self.cache[key] = causal_mask(i0 - j0, i1 - j0, 0, j1 - j0, self.device)
        return self.cache[key]


def fused_forward(qg, kg, vg, groups: int, causal: bool, block_q: int, block_k: int, log=None):
    """``flash_attention_forward``'s loops with fused tiles: (out, lse) shaped like qg and
    qg.shape[:-1], in qg's dtype (which is its accumulation dtype here)."""
    q4, k3, v3, g = _as_batches(qg, kg, vg, groups)
    bt, nq, d = q4.shape[0], q4.shape[2], q4.shape[3]
    scale = 1.0 / math.sqrt(d)
    out = torch.empty(bt, g, nq, d, dtype=qg.dtype, device=qg.device)
    lse = torch.empty(bt, g, nq, dtype=qg.dtype, device=qg.device)
    masks = _Masks(qg.device)
    for i0, i1 in blocks(nq, block_q):
        q_i = _rows(q4, i0, i1, scale)  # (Bt, G·bq, D), pre-scaled
        m = row_sum = acc = None
        for j0, j1 in visible_key_blocks(i0, i1, kg, block_k, causal, log):
            s = torch.bmm(q_i, k3[:, j0:j1].transpose(1, 2))  # (Bt, G·bq, bk) scaled scores
            mask = masks.get(i0, i1, j0, j1) if causal else None
            if mask is not None:
                s.view(bt, g, i1 - i0, j1 - j0).masked_fill_(mask, -math.inf)
            tile_max = s.amax(dim=-1)
            if m is None:  # first tile: nothing accumulated yet to rescale
                m = tile_max
                s.sub_(m[..., None]).exp_()
                row_sum = s.sum(dim=-1)
                acc = torch.bmm(s, v3[:, j0:j1])
                continue
            m_new = torch.maximum(m, tile_max)
            s.sub_(m_new[..., None]).exp_()
            alpha = m.sub_(m_new).exp_()  # exp(m_old - m_new), in m's storage
            row_sum.mul_(alpha).add_(s.sum(dim=-1))
            acc.mul_(alpha[..., None]).baddbmm_(s, v3[:, j0:j1])
            m = m_new
        out[:, :, i0:i1] = acc.div_(row_sum[..., None]).view(bt, g, i1 - i0, d)
        lse[:, :, i0:i1] = m.add_(row_sum.log_()).view(bt, g, i1 - i0)
        if log is not None:
            log.read(qg[..., i0:i1, :])
            log.write(qg[..., i0:i1, :], qg[..., i0:i1, 0])
    return out.view(qg.shape), lse.view(qg.shape[:-1])


def fused_backward(qg, kg, vg, do, o, lse, groups: int, causal: bool, block_q: int,
                   block_k: int, log=None):
    """``flash_attention_backward``'s loops with fused tiles (Dao 2023, Alg. 2): (dq, dk, dv)
    shaped like qg, k and v (before grouping), in the accumulation dtype."""
    q4, k3, v3, g = _as_batches(qg, kg, vg, groups)
    bt, nq, d = q4.shape[0], q4.shape[2], q4.shape[3]
    nk = k3.shape[1]
    scale = 1.0 / math.sqrt(d)
    do4, o4 = do.reshape(q4.shape), o.reshape(q4.shape)
    lse4 = lse.reshape(bt, g, nq, 1)
    neg_delta = (do4 * o4).sum(dim=-1, keepdim=True).neg_()  # -D_i = -rowsum(dO_i * O_i)
    q_blocks = blocks(nq, block_q)
    # per query block, once: q (unscaled), dO, -L, -D as (Bt, G·bq, ·) and its dQ accumulator
    rows = [(_rows(q4, i0, i1), _rows(do4, i0, i1), _rows(lse4, i0, i1).neg(),
             _rows(neg_delta, i0, i1)) for i0, i1 in q_blocks]
    dq = [torch.zeros_like(r[0]) for r in rows]
    dk = torch.empty(bt, nk, d, dtype=qg.dtype, device=qg.device)
    dv = torch.empty_like(dk)
    masks = _Masks(qg.device)
    for j0, j1 in blocks(nk, block_k):
        k_j, v_j = k3[:, j0:j1], v3[:, j0:j1]
        k_jt, v_jt = k_j.transpose(1, 2), v_j.transpose(1, 2)
        dk_j = torch.zeros(bt, j1 - j0, d, dtype=qg.dtype, device=qg.device)
        dv_j = torch.zeros_like(dk_j)
        for b, (i0, i1) in enumerate(q_blocks):
            if causal and j0 > i1 - 1:  # fully masked tile: nothing flows back through it
                if log is not None:
                    log.skipped += 1
                continue
            q_i, do_i, neg_lse_i, neg_delta_i = rows[b]
            p = torch.baddbmm(neg_lse_i, q_i, k_jt, alpha=scale).exp_()  # exp(s - L)
            mask = masks.get(i0, i1, j0, j1) if causal else None
            if mask is not None:
                p.view(bt, g, i1 - i0, j1 - j0).masked_fill_(mask, 0.0)
            dv_j.baddbmm_(p.transpose(1, 2), do_i)  # P^T dO, summed over the group's heads
            ds = p.mul_(torch.baddbmm(neg_delta_i, do_i, v_jt))  # P * (dP - D), in P's storage
            dq[b].baddbmm_(ds, k_j, alpha=scale)
            dk_j.baddbmm_(ds.transpose(1, 2), q_i, alpha=scale)
            if log is not None:
                log.tiles += 1
        dk[:, j0:j1], dv[:, j0:j1] = dk_j, dv_j
    dq_full = torch.cat([t.view(bt, g, -1, d) for t in dq], dim=2) if dq else torch.zeros_like(q4)
    return dq_full, dk, dv
