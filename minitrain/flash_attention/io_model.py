"""HBM traffic of attention: naive vs tiled, for an SRAM of M elements, and the FLOPs a
causal mask lets the tiles skip.

What it teaches (notebook 09_flash_attention): FlashAttention does *more* FLOPs than naive
attention (backward recomputes the scores) yet runs faster on GPUs because it moves fewer
bytes between HBM and SRAM. Dao et al. 2022, Theorem 2: standard attention needs
Θ(N d + N²) HBM accesses, FlashAttention Θ(N² d² / M) for SRAM size M (d <= M <= N d).
The counts here are exact for minitrain's loops and are checked against what the tiled
code records as it runs (``tiles.TileLog``). Counts are in elements, per (batch, head).
"""

from __future__ import annotations

from minitrain.flash_attention.tile_grid import blocks


def naive_io(n: int, d: int) -> dict:
    """Standard attention (Dao et al. 2022, Algorithm 0): read Q, K, write S = QK^T (N²);
    read S, write P = softmax(S) (N²); read P and V, write O. Θ(N d + N²)."""
    reads = 2 * n * d + n * n + (n * n + n * d)
    writes = n * n + n * n + n * d
    return {"reads": reads, "writes": writes, "total": reads + writes}


def block_size_for_sram(sram_elements: int, d: int) -> int:
    """Rows per tile so that Q_i, K_j, V_j and the O_i accumulator (four b x d blocks) fit in
    an SRAM of M elements: b = floor(M / 4d) (Dao et al. 2022, Algorithm 1, line 1)."""
    if sram_elements < 4 * d:
        raise ValueError(f"an SRAM of {sram_elements} elements cannot hold four rows of d={d}")
    return sram_elements // (4 * d)


def tiled_io(n_q: int, n_k: int, d: int, block_q: int, block_k: int, causal: bool = False) -> dict:
    """Exactly what ``flash_attention_forward`` moves (FA-2 loop order, Dao 2023 Alg. 1):
    each Q_i read once, each visible (K_j, V_j) pair read once per query block, O_i and
    L_i written once. Non-causal: reads = N d + 2 N d ceil(N / B_r)."""
    reads = writes = 0
    for i0, i1 in blocks(n_q, block_q):
        reads += (i1 - i0) * d
        for j0, j1 in blocks(n_k, block_k):
            if not (causal and j0 > i1 - 1):
                reads += 2 * (j1 - j0) * d
        writes += (i1 - i0) * d + (i1 - i0)  # O_i and the logsumexp L_i
    return {"reads": reads, "writes": writes, "total": reads + writes}


def tiled_io_for_sram(n: int, d: int, sram_elements: int, causal: bool = False) -> dict:
    """``tiled_io`` with the tiles an SRAM of M elements holds: about 8 N² d² / M + 2 N d."""
    b = block_size_for_sram(sram_elements, d)
    return tiled_io(n, n, d, b, b, causal)


def theorem2_bound(n: int, d: int, sram_elements: int) -> float:
    """The leading term N² d² / M of Theorem 2 (Dao et al. 2022), constant factor 1."""
    return n * n * d * d / sram_elements


def causal_tiles(n_q: int, n_k: int, block_q: int, block_k: int) -> dict:
    """Tiles computed and skipped by a causal forward, and the matmul FLOPs saved: a skipped
    tile would have cost 2 b_q b_k d (Q K^T) + 2 b_q b_k d (P V) FLOPs per unit of d."""
    computed = skipped = skipped_area = total_area = 0
    for i0, i1 in blocks(n_q, block_q):
        for j0, j1 in blocks(n_k, block_k):
            area = (i1 - i0) * (j1 - j0)
            total_area += area
            if j0 > i1 - 1:
                skipped += 1
                skipped_area += area
            else:
                computed += 1
    return {"computed": computed, "skipped": skipped,
            "flops_saved_per_d": 4 * skipped_area, "flops_dense_per_d": 4 * total_area,
            "fraction_saved": skipped_area / total_area if total_area else 0.0}
