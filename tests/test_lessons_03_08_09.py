"""Checkable lessons of notebooks 03, 08 and 09 that reviews found wrong (issue 43): each test
fails on the code that taught the wrong lesson."""

from __future__ import annotations

import pytest

from minitrain.flash_attention.io_model import (
    algorithm1_io,
    block_size_for_sram,
    tiled_io,
    tiled_io_for_sram,
)


@pytest.mark.parametrize("m, d, expected", [
    (25600, 64, (64, 100)),   # 100 KiB of fp32: B_c = M / 4d = 100, B_r capped at d
    (51200, 64, (64, 200)),   # 100 KiB of fp16
    (25601, 64, (64, 101)),   # ceil, as Algorithm 1 writes it
    (1024, 64, (4, 4)),       # M / 4d < d: square tiles
    (256, 64, (1, 1)),
])
def test_block_size_for_sram_is_algorithm_1_line_1(m, d, expected):
    # Dao et al. 2022, Algorithm 1, line 1: B_c = ceil(M / 4d), B_r = min(ceil(M / 4d), d)
    assert block_size_for_sram(m, d) == expected


def test_block_size_for_sram_keeps_the_score_tile_small():
    for m in (4096, 25600, 51200, 65536):
        b_r, b_c = block_size_for_sram(m, 64)
        assert b_r * b_c <= 64 * -(-m // 256)  # S_ij within d ceil(M / 4d), about M / 4
    with pytest.raises(ValueError):
        block_size_for_sram(100, 64)


def test_tiled_io_for_sram_uses_algorithm_1_tiles():
    n, d, m = 1024, 64, 25600
    b_r, b_c = block_size_for_sram(m, d)
    assert tiled_io_for_sram(n, d, m) == algorithm1_io(n, n, d, b_r, b_c)
    assert tiled_io_for_sram(n, d, m, causal=True) == algorithm1_io(n, n, d, b_r, b_c, True)
    assert tiled_io_for_sram(n, d, m, order="fa2") == tiled_io(n, n, d, b_r, b_c)
    with pytest.raises(ValueError):
        tiled_io_for_sram(n, d, m, order="fa3")


def test_algorithm1_io_counts_key_blocks_outside():
    # N = 8, d = 2, tiles 4 x 4: K, V read once (2 N d); per (key block, query block) pair Q_i, O_i,
    # l_i, m_i read (4 (2d + 2)) and O_i, l_i, m_i written (4 (d + 2)); 2 x 2 pairs
    io = algorithm1_io(8, 8, 2, 4, 4)
    assert io["reads"] == 2 * 8 * 2 + 4 * 4 * (2 * 2 + 2) and io["writes"] == 4 * 4 * (2 + 2)
    causal = algorithm1_io(8, 8, 2, 4, 4, causal=True)  # the (key block 1, query block 0) pair is skipped
    assert causal["reads"] == 2 * 8 * 2 + 3 * 4 * (2 * 2 + 2) and causal["writes"] == 3 * 4 * (2 + 2)
