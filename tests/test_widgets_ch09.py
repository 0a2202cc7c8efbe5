"""Tests of the chapter 9 widget: the traced tiles against the full softmax (computed here
independently), the tile grid against the causal rule, the IO view against the recorded
counts, and the headless builder."""

import math

import matplotlib
import pytest
import torch

from minitrain.widgets.ch09_flash_attention import (
    build_flash_widget,
    compute_io_view,
    compute_tile_view,
    trace_tiles,
)

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def trace():
    return trace_tiles(n=10, d=4, block_q=4, block_k=3, causal=True)


def test_last_tile_of_each_block_matches_the_full_softmax(trace):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(10, 4, generator=g) for _ in range(3))
    full = torch.softmax((q @ k.T / 2).masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), -math.inf), -1) @ v
    finals = [i for i in range(len(trace["steps"])) if trace["steps"][i]["last_of_block"]]
    assert len(finals) == 3  # query blocks 0-3, 4-7, 8-9
    for i in finals:
        view = compute_tile_view(trace, i)
        r0, r1 = view["rows"][0], view["rows"][-1] + 1
        torch.testing.assert_close(view["partial"], full[r0:r1], atol=1e-6, rtol=1e-6)
        assert view["final_error"] < 1e-6 and view["lse_error"] < 1e-6
    torch.testing.assert_close(trace["flash"], full, atol=1e-6, rtol=1e-6)


def test_grid_marks_current_done_and_skipped_tiles(trace):
    # causal, query blocks of 4 and key blocks of 3: block i visits key blocks j with 3j <= 4i + 3
    visits = [(i, j) for i in range(3) for j in range(4) if 3 * j <= min(4 * i + 3, 9)]
    assert len(trace["steps"]) == len(visits)
    view = compute_tile_view(trace, 2)
    flat = {(i, j): c for i, row in enumerate(view["grid"]) for j, c in enumerate(row)}
    assert flat[visits[2]] == "current" and all(flat[t] == "done" for t in visits[:2])
    assert {t for t, c in flat.items() if c == "skipped"} == {(i, j) for i in range(3) for j in range(4)} - set(visits)
    assert view["in_sram"]["K"] == view["in_sram"]["V"]
    with pytest.raises(ValueError, match=str(len(visits) - 1)):
        compute_tile_view(trace, len(visits))


def test_io_view_recorded_equals_formula_and_shrinks_with_the_tile():
    small, large = compute_io_view(32, 4, 2), compute_io_view(32, 4, 16)
    for view in (small, large):
        assert view["recorded"] == view["formula"]
    assert large["formula"] < small["formula"] and large["sram_elements"] == 4 * 16 * 4 + 16 * 16


def test_widget_redraws_when_the_sliders_move(trace):
    widget = build_flash_widget(trace, step=0, block=2)
    step_slider, block_slider = widget.children[0].children
    readout = widget.children[1]
    first = readout.value
    assert "tile 1 of" in first and "tile size 2" in first
    step_slider.value = 3
    assert "tile 4 of" in readout.value
    block_slider.value = 5
    assert "tile size 5" in readout.value
