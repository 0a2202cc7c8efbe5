"""Chapter 6 on a modeled link (issue 42): where tensor parallelism stops scaling
(minitrain.tensor_parallel.measure_link). The formulas exactly; the measurement (slow) only
what notebooks/06_tensor_parallel.ipynb compares, with widths 16× apart."""

from __future__ import annotations

import pytest

from minitrain.runtime.link import Link
from minitrain.runtime.link_costs import all_reduce_time
from minitrain.tensor_parallel import measure_link

L = Link(5e-4, 30e6, "test")


def test_block_communication_is_four_all_reduces_of_bsh():
    got = measure_link.block_communication_seconds(2, 32, 256, 2, L)
    assert got == pytest.approx(4 * all_reduce_time(2 * 32 * 256 * 4, 2, L))
    assert measure_link.block_communication_seconds(2, 32, 256, 1, L) == 0


def test_predicted_time_splits_compute_and_adds_the_all_reduces():
    comm = measure_link.block_communication_seconds(1, 32, 512, 2, L)
    assert measure_link.predicted_time(0.2, 1, 32, 512, 2, L) == pytest.approx(0.1 + comm)


def test_crossover_is_where_the_all_reduces_cost_what_they_save():
    k = 5e-8  # s per h²: T₁(h) = k·h²
    widths = [128, 512, 2048]
    h = measure_link.crossover_width(widths, [k * w**2 for w in widths], 1, 32, 2, L)
    saved = 0.5 * k * h**2
    assert measure_link.block_communication_seconds(1, 32, h, 2, L) == pytest.approx(saved)
    faster = Link(L.alpha / 2, L.bandwidth * 2)  # a faster link: TP pays off sooner
    assert measure_link.crossover_width(widths, [k * w**2 for w in widths], 1, 32, 2,
                                        faster) < h


@pytest.mark.slow
def test_tp_hurts_narrow_and_gains_with_width_on_a_link():
    # what the notebook compares; "t = 2 faster at h = 1024" needs two free cores (1.1–1.5×
    # measured, 1.6× predicted) and a shared machine denies them: not asserted
    run = measure_link.measure_widths((64, 1024), batch=1, seq_len=32, steps=3)
    assert run["speedup"][0] < 1 and run["speedup"][0] < run["speedup"][-1], run["speedup"]
    assert 64 < run["crossover"] < 1024
