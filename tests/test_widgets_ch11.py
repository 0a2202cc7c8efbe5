"""The chapter 11 planner widget: its rows are the planner's, they fit, they are ranked, and
the headless widget reacts to its controls."""

import pytest

from minitrain.widgets.ch11_planner import build_planner_widget, compute_plan


def test_rows_fit_are_ranked_and_react_to_memory():
    view = compute_plan("7.5B", 64, 80, 300, 25, top=5)
    rows = view["rows"]
    assert rows and all(r["memory"]["total"] <= 80e9 for r in rows)
    times = [r["time"]["total"] for r in rows]
    assert times == sorted(times)
    for r in rows:  # the parts add up to the totals the bars show
        assert sum(r["memory"][k] for k in ("params", "grads", "optimizer", "activations")) == \
            pytest.approx(r["memory"]["total"])
        lo = r["layout"]
        assert lo.dp * lo.tp * lo.pp * lo.cp == 64
    # 7.5B parameters need 120 GB of model states unsharded: with 16 GB nothing unsharded fits
    small = compute_plan("7.5B", 64, 16, 300, 25, top=50)["rows"]
    assert small and all(r["layout"].tp * r["layout"].pp > 1 or r["layout"].zero > 0 for r in small)
    assert compute_plan("1008.0B", 8, 16, 300, 25)["rows"] == []
    with pytest.raises(ValueError, match="unknown model"):
        compute_plan("3B", 8, 80, 300, 25)


def test_widget_updates_headlessly():
    box = build_planner_widget()
    (model, devices), (memory, _, _) = box.children[0].children, box.children[1].children
    status = box.children[2]
    before = status.value
    assert "layouts fit" in before and "<table>" in before
    model.value = "1.7B"
    devices.value = 8
    assert status.value != before
    memory.value = 16
    model.value = "1008.0B"
    assert "No layout fits" in status.value
