"""The tile grid of FlashAttention (notebook 09_flash_attention): which (query block, key
block) tiles exist, which a causal query block must visit, and the mask of a diagonal tile.

Shared by the readable tiles (``tiles.py``, chapter 9's exercises), the fused tiles
(``fused_tiles.py``), the HBM-traffic model (``io_model.py``) and chapter 9's widget, so all of
them walk — and count — the same tiles (Dao 2023, Algorithm 1's loops).
"""

from __future__ import annotations

import torch


def blocks(n: int, size: int):
    """(start, end) of consecutive blocks of ``size`` rows covering 0..n (the last one short)."""
    return [(s, min(s + size, n)) for s in range(0, n, size)]


def causal_mask(i0: int, i1: int, j0: int, j1: int, device=None):
    """Boolean (i1-i0, j1-j0) tile mask, True where key j is in the future of query i
    (j > i), or None when the tile is fully visible (j1 - 1 <= i0)."""
    if j1 - 1 <= i0:
        return None
    rows = torch.arange(i0, i1, device=device)[:, None]
    return torch.arange(j0, j1, device=device)[None, :] > rows


def visible_key_blocks(i0: int, i1: int, k, block_k: int, causal: bool, log=None):
    """Key blocks (j0, j1) of k (..., Nk, D) a query block [i0, i1) must visit. Causal: a
    key block starting after the block's last query (j0 > i1 - 1) is fully masked and
    skipped — its FLOPs never spent. ``log`` records each visited tile's K_j, V_j reads."""
    visit = []
    for j0, j1 in blocks(k.shape[-2], block_k):
        if causal and j0 > i1 - 1:
            if log is not None:
                log.skipped += 1
            continue
        visit.append((j0, j1))
        if log is not None:
            log.tiles += 1
            log.reads += 2 * k[..., j0:j1, :].numel()  # K_j and V_j (same shape)
    return visit
