"""Tests of the chapter 1 memory-calculator widget (compute function and headless builder)."""

import pytest

from minitrain.memory import estimate_training_memory
from minitrain.model import GPTConfig, gpt_num_params
from minitrain.widgets.ch01_memory import build_memory_widget, compute_memory_breakdown


def test_breakdown_model_states_and_batches():
    r = compute_memory_breakdown(2, 64, 4, 64, 32, batch=6, precision="fp32")
    n = gpt_num_params(GPTConfig())
    assert r["num_params"] == n
    assert r["batch_sizes"] == [1, 2, 4, 6]
    assert (r["weights"], r["gradients"], r["optimizer"]) == (4 * n, 4 * n, 8 * n)
    # activations are linear in the batch; totals add the fixed model states
    a = r["activations"]
    assert a[2] - a[0] == 3 * (a[1] - a[0])  # batch 4 adds three times what batch 2 adds
    assert r["totals"] == [16 * n + a for a in r["activations"]]
    assert r["activations"] == sorted(r["activations"])


def test_breakdown_mixed_is_20_bytes_per_parameter():
    r = compute_memory_breakdown(32, 4096, 32, 50257, 2048, batch=1, precision="mixed")
    total_states = r["weights"] + r["gradients"] + r["optimizer"]
    assert total_states == estimate_training_memory(r["num_params"], "mixed")["total"]
    assert total_states == 20 * r["num_params"]


def test_breakdown_rejects_bad_batch():
    with pytest.raises(ValueError, match="batch"):
        compute_memory_breakdown(2, 64, 4, 64, 32, batch=0)


def test_widget_updates_when_a_slider_moves():
    widget = build_memory_widget(
        measured={"config": GPTConfig(), "batch": 4, "precision": "fp32", "bytes": 1e6}
    )
    controls = widget.children[0].children[0].children
    readout = widget.children[1]
    before = readout.value
    assert "parameters" in before
    controls[0].value = 6  # layers
    assert readout.value != before
    assert f"{gpt_num_params(GPTConfig(n_layer=6)):,}" in readout.value
    controls[1].value = 48 if 48 in controls[1].options else 128  # width
    assert readout.value != before
