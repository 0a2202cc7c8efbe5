"""The chapter 6 widget: built on real measurements (TP 1 and 2, SP off and on), its view
equals the formulas, and the headless widget reacts to every control."""

import pytest

from minitrain.widgets.ch06_tensor_parallel import build_tp_widget, compute_tp_view

SHAPE = dict(batch=2, seq_len=16, d_model=32, n_head=4, d_ff=128, vocab_size=64)
CONFIG = dict(vocab_size=64, seq_len=16, n_layer=1, n_head=4, d_model=32)


@pytest.fixture(scope="module")
def measured():
    from minitrain.tensor_parallel.measure import measure_layers

    return {(t, sp): measure_layers(CONFIG, 2, t, sp) for t in (1, 2) for sp in (False, True)}


def test_view_reads_the_real_shards_and_matches_the_formulas(measured):
    view = compute_tp_view("mlp", "row", 2, False, measured, SHAPE)
    name, entries = view["weights"][0]
    assert name == "blocks.0.mlp.fc_out.weight"
    assert entries == [("split", 1, 0, 64, 128), ("split", 1, 64, 128, 128)]
    assert view["measured"] == view["formula"]
    assert view["measured"]["forward"]["collectives"] == ["all-reduce"]
    assert view["activation"]["measured"] == [view["activation"]["formula"]] * 2
    sp = compute_tp_view("embedding", "row", 2, True, measured, SHAPE)  # falls back to vocab
    assert sp["split"] == "vocab" and sp["measured"]["forward"]["collectives"] == ["reduce-scatter"]
    with pytest.raises(ValueError, match="TP size 4"):
        compute_tp_view("mlp", "row", 4, False, measured, SHAPE)


def test_widget_updates_headlessly(measured):
    box = build_tp_widget(measured, SHAPE)
    layer, split, (tp, sp), status, image = (box.children[0], box.children[1],
                                             box.children[2].children, box.children[3],
                                             box.children[4])
    before, picture = status.value, bytes(image.value)
    assert "q_proj.weight: rank 0 holds rows 0–15 of 32" in before
    split.value = "row"
    assert "out_proj.weight: rank 0 holds columns 0–15 of 32" in status.value
    assert bytes(image.value) != picture
    sp.value = True
    assert "all-gather ×1, reduce-scatter ×1" in status.value
    layer.value = "head"
    assert "head.weight: rank 0 holds rows 0–31 of 64" in status.value
    # only the head's own split is offered: a "row" button would change nothing
    assert split.options == ("vocab",) and split.value == "vocab"
    layer.value = "mlp"
    assert split.options == ("column", "row") and "fc_in.weight" in status.value
    tp.value = 1
    assert "rank 0 holds all of it" in status.value and "forward: none" in status.value
