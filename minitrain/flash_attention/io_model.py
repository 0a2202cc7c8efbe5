"""HBM traffic of attention: naive vs tiled, for an SRAM of M elements, and the FLOPs a
causal mask lets the tiles skip.

What it teaches (notebook 09_flash_attention): FlashAttention does *more* FLOPs than naive
attention (backward recomputes the scores) yet runs faster on GPUs because it moves fewer
bytes between HBM and SRAM. Dao et al. 2022, Theorem 2: standard attention needs
Θ(N d + N²) HBM accesses, FlashAttention Θ(N² d² / M) for SRAM size M (d <= M <= N d).
Two loop orders are counted: ``tiled_io`` is minitrain's (FlashAttention-2: query blocks
outside), exact for its loops and checked against what the tiled code records as it runs
(``tiles.TileLog``); ``algorithm1_io`` is Dao et al. 2022's Algorithm 1 (key blocks
outside), the algorithm Theorem 2 and ``block_size_for_sram`` belong to. Counts are in
elements, per (batch, head).
"""

from __future__ import annotations

from minitrain.flash_attention.tile_grid import blocks


def naive_io(n: int, d: int) -> dict:
    """Standard attention (Dao et al. 2022, Algorithm 0): read Q, K, write S = QK^T (N²);
    read S, write P = softmax(S) (N²); read P and V, write O. Θ(N d + N²)."""
    reads = 2 * n * d + n * n + (n * n + n * d)
    writes = n * n + n * n + n * d
    return {"reads": reads, "writes": writes, "total": reads + writes}


def block_size_for_sram(sram_elements: int, d: int) -> tuple[int, int]:
    """``(B_r, B_c)`` of Dao et al. 2022, Algorithm 1, line 1: B_c = ceil(M / 4d) key rows and
    B_r = min(ceil(M / 4d), d) query rows. Q_i, O_i, K_j and V_j are four blocks of at most
    ceil(M / 4d) x d elements, about M in all; B_r <= d keeps the B_r x B_c score tile S_ij
    (and P_ij) within d ceil(M / 4d), about M / 4, as well. E.g. M = 25600, d = 64: (64, 100)."""
    if sram_elements < 4 * d:
        raise ValueError(f"an SRAM of {sram_elements} elements cannot hold four rows of d={d}")
    b_c = -(-sram_elements // (4 * d))  # ceil, as the paper writes it
    return min(b_c, d), b_c


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


def algorithm1_io(n_q: int, n_k: int, d: int, block_q: int, block_k: int, causal: bool = False) -> dict:
    """What Dao et al. 2022's Algorithm 1 moves (FlashAttention-1 loop order): key blocks
    outside, each K_j, V_j read once (line 6); for every visible query block, Q_i, O_i, l_i,
    m_i read (line 8) and O_i, l_i, m_i written back (lines 12-13). Non-causal: reads =
    2 N d + T_c (2 N d + 2 N), writes = T_c (N d + 2 N), T_c = ceil(N / B_c): with
    B_c = M / 4d about 12 N² d² / M, Theorem 2's Θ(N² d² / M)."""
    reads = writes = 0
    for j0, j1 in blocks(n_k, block_k):
        reads += 2 * (j1 - j0) * d
        for i0, i1 in blocks(n_q, block_q):
            if not (causal and j0 > i1 - 1):
                reads += (i1 - i0) * (2 * d + 2)
                writes += (i1 - i0) * (d + 2)
    return {"reads": reads, "writes": writes, "total": reads + writes}


def tiled_io_for_sram(n: int, d: int, sram_elements: int, causal: bool = False,
                      order: str = "fa1") -> dict:
    """HBM accesses with the tiles ``(B_r, B_c) = block_size_for_sram(M, d)`` of Algorithm 1.
    ``order="fa1"``: Algorithm 1's own loops (``algorithm1_io``), about 12 N² d² / M + 2 N d.
    ``order="fa2"``: minitrain's loops (``tiled_io``) with the same tiles: K and V are read
    once per query block, N / B_r times, and B_r <= d, so about 2 N² + 2 N d whatever M is —
    the block on the *outer* loop is the one whose size must grow with M."""
    b_r, b_c = block_size_for_sram(sram_elements, d)
    if order == "fa1":
        return algorithm1_io(n, n, d, b_r, b_c, causal)
    if order == "fa2":
        return tiled_io(n, n, d, b_r, b_c, causal)
    raise ValueError(f"order must be 'fa1' or 'fa2', got {order!r}")


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
