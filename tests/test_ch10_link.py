"""Chapter 10 on a modeled link (issue 42): ring attention's K, V transfer is exposed below the
overlap threshold n = e·F/(2W) and hidden above it, and the wait matches max(0, transfer −
compute). Justifies notebook 10's compared line (its sizes, its third-of-the-transfer rule)."""

import pytest
from timing_checks import measured_twice

from minitrain.context_parallel.measure import measure_overlap, overlap_threshold
from minitrain.runtime.link_costs import p2p_time


def test_threshold_formula():
    # e·F/(2W): 4-byte elements, 10 GFLOP/s, 40 MB/s -> 500 tokens per rank
    assert overlap_threshold(10e9, 40e6) == pytest.approx(500)
    assert overlap_threshold(312e12, 300e9, bytes_per_element=2) == pytest.approx(1040)  # A100, NVLink


@pytest.mark.slow
def test_exposed_below_the_threshold_hidden_above_as_the_notebook_measures():
    def check():
        result = measure_overlap(sizes=(64, 128, 1536, 2048), threshold=512)
        assert result["threshold"] == pytest.approx(512)
        link = result["link"]
        for n, row in result["sizes"].items():
            assert row["transfer"] == pytest.approx(p2p_time(2 * 8 * n * 64 * 4, link))
            assert row["predicted_exposed"] == pytest.approx(max(0.0, row["transfer"] - row["compute"]))
            assert row["hidden"] == (n > 512), (n, row)
            if n < 512:  # the wait is the transfer the compute left uncovered
                assert row["exposed"] > 0.5 * row["predicted_exposed"], (n, row)

    measured_twice(check)
