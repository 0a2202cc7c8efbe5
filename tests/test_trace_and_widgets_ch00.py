"""minitrain.runtime.trace (events, overlap, timeline) and the ring widget of notebook 00."""

import matplotlib

matplotlib.use("Agg")

from minitrain.runtime import trace  # noqa: E402
from minitrain.runtime.trace import Event  # noqa: E402
from minitrain.widgets.ch00_ring import build_ring_widget, measure_ring_pass  # noqa: E402


def test_span_records_and_reset_clears():
    trace.reset()
    with trace.span("a", "compute"):
        pass
    trace.record("b", "communication", 1.0, 2.5)
    names = sorted(e.name for e in trace.events())
    assert names == ["a", "b"]
    assert [e.duration for e in trace.events() if e.name == "b"] == [1.5]
    trace.reset()
    assert trace.events() == []


def test_overlap_is_the_measure_of_the_intersection_of_unions():
    a = [Event("x", "compute", 0, 2), Event("y", "compute", 1, 3), Event("z", "compute", 5, 6)]
    b = [Event("c", "communication", 2.5, 5.5)]
    # union of a = [0,3] ∪ [5,6]; with [2.5,5.5]: 0.5 + 0.5
    assert trace.overlap_seconds(a, b) == 1.0


def test_unknown_kind_is_refused():
    import pytest

    with pytest.raises(ValueError, match="'gpu' is not one of"):
        trace.record("x", "gpu", 0, 1)


def test_plot_timeline_draws_one_row_per_rank():
    traces = [[Event("f", "compute", 0, 1)], [Event("ar", "communication", 0.5, 2)]]
    ax = trace.plot_timeline(traces, title="t")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    assert len(ax.collections) == 2


def test_ring_measurement_gives_the_exact_sum_and_a_trace_per_rank():
    value, traces = measure_ring_pass(3, 16, rounds=2)
    assert value == 2 * (1 + 2 + 3)
    assert len(traces) == 3
    assert all(any(e.kind == "communication" for e in evs) for evs in traces)


def test_ring_widget_remeasures_when_the_slider_moves():
    box = build_ring_widget(default_world_size=2)
    ranks, _ = box.children[0].children
    status = box.children[1]
    assert "2 ranks, 2 rounds: token on rank 0 = 6 (expected 6)" in status.value
    ranks.value = 3
    assert "3 ranks, 2 rounds: token on rank 0 = 12 (expected 12)" in status.value
