"""Tests of the chapter 3 checkpointing widget (measurements, pure view, headless builder)."""

import math

import matplotlib
import pytest

from minitrain.widgets.ch03_checkpointing import (
    build_checkpointing_widget,
    compute_checkpointing_view,
    measure_checkpointing,
)

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def data():
    return measure_checkpointing(n_layer=3, batch=2, repeats=1, seq_len=16)


def test_view_numbers_match_the_formulas(data):
    cfg = data["config"]
    b, s, h, a = 2, 16, cfg.d_model, cfg.n_head
    none = compute_checkpointing_view(data, "none", 1)
    assert none["extra_flops"] == 0 and none["saved"] == none["base_saved"]
    for policy in ("full", "selective", "every_k", "segments"):
        for k in (1, 2, 3):
            view = compute_checkpointing_view(data, policy, k)
            assert view["saved"] == view["saved_predicted"], (policy, k)
            assert view["extra_flops"] == view["extra_flops_predicted"], (policy, k)
            assert view["time_ratio"] > 0
    # an independent check of two numbers: selective drops the s x s tensors of each block,
    # segments(3) recomputes the first two blocks' forward
    sel = compute_checkpointing_view(data, "selective", 1)
    assert none["saved"] - sel["saved"] == 3 * a * s * s * b * (4 + 1 + 4)
    seg = compute_checkpointing_view(data, "segments", 3)
    block_fwd = 2 * b * s * (4 * h * h + 2 * h * 4 * h) + 4 * b * s * s * h
    assert seg["extra_flops"] == 2 * block_fwd
    curves = seg["curves"]
    assert curves["k"] == [1, 2, 3] and curves["segments_saved"] == curves["segments_predicted"]
    assert curves["segments_peak"][0] == none["peak"]
    # the fraction's denominator, the un-checkpointed step: backward does every matmul twice,
    # so 3x the forward of 3 blocks and the LM head (2 b s h V)
    step = 3 * (3 * block_fwd + 2 * b * s * h * cfg.vocab_size)
    assert math.isclose(seg["extra_flops_fraction"], 2 * block_fwd / step)


def test_view_rejects_bad_choices(data):
    with pytest.raises(ValueError, match="'partial'"):
        compute_checkpointing_view(data, "partial", 1)
    with pytest.raises(ValueError, match="4"):
        compute_checkpointing_view(data, "segments", 4)


def test_widget_redraws_when_the_controls_move(data):
    widget = build_checkpointing_widget(data, policy="segments", k=1)
    chooser, slider = widget.children[0].children
    readout = widget.children[1]
    first = readout.value
    assert "segments(1)" in first
    slider.value = 3
    assert readout.value != first and "segments(3)" in readout.value
    chooser.value = "selective"
    assert "selective" in readout.value


def test_k_slider_is_disabled_for_policies_without_k(data):
    widget = build_checkpointing_widget(data, policy="full", k=2)
    chooser, slider = widget.children[0].children
    assert slider.disabled
    for policy in ("every_k", "segments"):
        chooser.value = policy
        assert not slider.disabled, policy
    for policy in ("none", "full", "selective"):
        chooser.value = policy
        assert slider.disabled, policy


def test_view_predicts_the_measured_peak(data):
    for policy in ("none", "full", "selective", "every_k", "segments"):
        for k in (1, 2, 3):
            view = compute_checkpointing_view(data, policy, k)
            assert view["peak"] == view["peak_predicted"], (policy, k)
    curves = compute_checkpointing_view(data, "segments", 2)["curves"]
    assert curves["segments_peak"] == curves["segments_peak_predicted"]
    assert curves["every_k_peak"] == curves["every_k_peak_predicted"]

