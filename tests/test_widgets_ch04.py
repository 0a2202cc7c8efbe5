"""The chapter 4 widget: pure view function on a synthetic sweep, and the headless widget."""

import math

import pytest

from minitrain.runtime.trace import Event
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
    chooser, slider, summary, curve, image = box.children
    assert chooser.layout.display == "none"  # one link (or none): nothing to choose
    before = (summary.value, bytes(image.value))
    assert "12.0 ms" in before[0] and len(before[1]) > 1000 and len(bytes(curve.value)) > 1000
    assert "model" not in before[0]  # measured without a link: no modeled step
    slider.value = math.inf
    assert "14.0 ms" in summary.value and "1</b> buckets" in summary.value
    assert bytes(image.value) != before[1]


def _linked_sweep(model_ms):
    sweep = _sweep()
    sweep["model_step"] = {cap: ms / 1e3 for cap, ms in zip(sweep["caps"], model_ms)}
    return sweep


def test_link_selector_switches_sweeps_and_shows_the_model():
    from minitrain.widgets.ch04_ddp import best_caps

    low, high = _linked_sweep([11.0, 15.0]), _linked_sweep([20.0, 16.0])
    assert best_caps(low) == (1.0, 1.0) and best_caps(high) == (1.0, math.inf)
    assert best_caps(_sweep()) == (1.0, None)
    box = build_bucket_widget({"links": {"low α": low, "high α": high}})
    chooser, slider, summary, curve, image = box.children
    assert list(chooser.options) == ["low α", "high α"] and chooser.layout.display == ""
    assert "α–β model: 11.0 ms" in summary.value
    before = bytes(curve.value)
    chooser.value = "high α"
    assert "α–β model: 20.0 ms" in summary.value and bytes(curve.value) != before
    assert compute_bucket_view(high, math.inf)["model_ms"] == pytest.approx(16.0)


def test_hidden_share_is_the_median_over_steps():
    from minitrain.ddp import hidden_share_per_step, summarize_shares

    def step(c0, c1):  # backward computes 0..10 ms; one all-reduce c0..c1 on both ranks
        events = [Event("backward", "compute", 0.0, 0.010),
                  Event("all-reduce bucket 0", "communication", c0, c1)]
        return [events, events]

    # hidden 50 %, 0 %, 100 %, 25 %, 75 % in five steps
    steps = [step(0.008, 0.012), step(0.010, 0.014), step(0.002, 0.006), step(0.009, 0.013),
             step(0.007, 0.011)]
    shares = hidden_share_per_step(steps)
    assert shares == pytest.approx([0.5, 0.0, 1.0, 0.25, 0.75])
    spread = summarize_shares(shares)
    assert spread["median"] == pytest.approx(0.5) and spread["steps"] == 5
    assert (spread["q1"], spread["q3"]) == pytest.approx((0.25, 0.75))
    sweep = _sweep()
    sweep["step_traces"] = {1.0: steps, math.inf: [step(0.010, 0.014)] * 3}
    view = compute_bucket_view(sweep, 1.0)
    assert view["hidden_share"] == pytest.approx(0.5) and view["steps"] == 5
    assert view["hidden_quartiles"] == pytest.approx((0.25, 0.75))
    assert compute_bucket_view(sweep, math.inf)["hidden_share"] == 0.0


def test_waiting_inside_backward_hides_nothing():
    from minitrain.ddp import hidden_communication_share

    # backward 0..10 ms; an all-reduce 6..10 ms whose launch held backward from 6 to 9 ms
    events = [Event("backward", "compute", 0.0, 0.010),
              Event("all-reduce bucket 0", "communication", 0.006, 0.010),
              Event("launching all-reduce (backward waits)", "idle", 0.006, 0.009)]
    assert hidden_communication_share(events) == pytest.approx(0.25)  # only 9..10 ms hidden
