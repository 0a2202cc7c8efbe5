"""The chapter 4 widget: pure view function on a synthetic sweep, and the headless widget."""

import math

import pytest

from minitrain.trace import Event
from minitrain.widgets.ch04_ddp import build_bucket_widget, compute_bucket_view, count_buckets


def _sweep():
    # compute 0..10 ms; communication 8..12 ms (cap 1) or 10..14 ms (cap inf), two ranks
    def events(c0, c1):
        return [
            Event("backward", "compute", 0.0, 0.010),
            Event("all-reduce bucket 0", "communication", c0, c1),
        ]

    return {
        "caps": [1.0, math.inf],
        "param_bytes": [4 * 2**20, 4 * 2**20, 2**20],
        "step_time": {1.0: 0.012, math.inf: 0.014},
        "traces": {1.0: [events(0.008, 0.012)] * 2, math.inf: [events(0.010, 0.014)] * 2},
    }


def test_count_buckets_matches_the_rule():
    # reversed sizes 1 MB, 4 MB, 4 MB with a 1 MB cap: each closes its own bucket
    assert count_buckets([4 * 2**20, 4 * 2**20, 2**20], 1.0) == 3
    assert count_buckets([4 * 2**20, 4 * 2**20, 2**20], 5.0) == 2
    assert count_buckets([4 * 2**20, 4 * 2**20, 2**20], math.inf) == 1
    assert count_buckets([4, 4], 0.0) == 2


def test_compute_bucket_view():
    view = compute_bucket_view(_sweep(), 1.0)
    assert view["buckets"] == 3
    assert view["step_ms"] == pytest.approx(12.0)
    assert view["hidden_share"] == pytest.approx(0.5)  # 2 of the 4 ms overlap compute
    assert compute_bucket_view(_sweep(), math.inf)["hidden_share"] == pytest.approx(0.0)
    with pytest.raises(ValueError, match="0.5"):
        compute_bucket_view(_sweep(), 0.5)


def test_widget_updates_headlessly():
    box = build_bucket_widget(_sweep())
    slider, summary, image = box.children
    before = (summary.value, bytes(image.value))
    assert "12.0 ms" in before[0] and len(before[1]) > 1000
    slider.value = math.inf
    assert "14.0 ms" in summary.value and "1</b> buckets" in summary.value
    assert bytes(image.value) != before[1]
