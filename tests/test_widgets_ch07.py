"""The chapter 7 widget: its grid is the schedule data, its numbers the simulation's and the
measured run's, and the headless widget reacts to every control."""

from fractions import Fraction

from minitrain.pipeline import one_f_one_b_schedule, simulate
from minitrain.widgets.ch07_pipeline import build_pipeline_widget, compute_pipeline_view


def test_view_is_the_schedule_data_and_the_measured_run():
    from minitrain.pipeline.measure import run_pipelines

    result = run_pipelines("gpt", 2, 4, [("1f1b", 1)], unit=0.01,
                           config=dict(vocab_size=32, seq_len=16, n_layer=2, n_head=2, d_model=16))
    view = compute_pipeline_view("1f1b", 2, 4, 1, "gpt", result[("1f1b", 1)])
    want = one_f_one_b_schedule(2, 4)
    assert [[(k, mb) for _, _, k, mb, _ in row] for row in view["grid"]] == want
    assert view["predicted_bubble"] == float(Fraction(1, 5)) == float(simulate(want).bubble_fraction)
    assert view["peak_in_flight"] == [2, 1]
    names = [[n for _, _, n, k in evs if k == "compute"] for evs in view["measured"]]
    assert names == [[f"{k}{mb}" for k, mb in stage] for stage in want]  # ran in that order
    assert view["peak_bytes"] == view["predicted_peak_bytes"]
    assert 0 < view["measured_bubble"] < 1


def test_widget_updates_headlessly():
    box = build_pipeline_widget(unit=0.005)
    (name, kind), (p, m, v), status, image = (box.children[0].children, box.children[1].children,
                                              box.children[2], box.children[3])
    assert "<b>1f1b</b>, p = 2, m = 4, v = 1" in status.value and "predicted 0.200" in status.value
    picture = bytes(image.value)
    name.value = "interleaved"
    assert "<b>interleaved</b>, p = 2, m = 4, v = 2" in status.value
    assert "predicted 0.111" in status.value and bytes(image.value) != picture
    v.value = 3
    assert "v = 3" in status.value and "predicted 0.077" in status.value
    p.value = 3
    m.value = 3
    assert "p = 3, m = 3, v = 3" in status.value and "predicted 0.182" in status.value
    kind.value = "gpt"
    assert "peak activation bytes per stage: measured" in status.value
