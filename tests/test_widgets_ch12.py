"""Chapter 12's roofline widget: the ops it places and the bytes it sums, against the shapes'
own counts; the widget re-draws when a slider moves."""

import pytest

from minitrain.kernels.roofline import attainable, mlp_ops, predicted_seconds
from minitrain.widgets.ch12_roofline import build_roofline_widget, compute_roofline_view

FLOPS, BANDWIDTH = 1e11, 1e10  # a ridge point of 10 FLOP/byte


def test_matmul_counts_follow_the_shapes():
    up = next(op for op in mlp_ops(512, 128, fused=False) if op["name"] == "up-projection")
    assert up["flops"] == 2 * 512 * 128 * 512
    assert up["bytes"] == 4 * (512 * 128 + 128 * 512 + 512 * 512)


def test_fusing_moves_fewer_bytes_and_leaves_the_matmuls_flops():
    view = compute_roofline_view(256, 1024, FLOPS, BANDWIDTH)
    assert view["fused"]["bytes"] < view["eager"]["bytes"]
    matmul_flops = [sum(op["flops"] for op in view[v]["ops"] if op["kind"] == "matmul")
                    for v in ("eager", "fused")]
    assert matmul_flops[1] >= matmul_flops[0]  # the epilogues' few FLOPs join the matmuls
    assert view["speedup"] > 1
    assert set(view["eager"]["memory_bound"]) >= {"GELU", "residual add"}
    assert "up-projection" not in view["eager"]["memory_bound"]


def test_the_roofline_caps_each_op():
    assert attainable(1.0, FLOPS, BANDWIDTH) == 1e10 and attainable(100, FLOPS, BANDWIDTH) == 1e11
    ops = [{"flops": 1e9, "bytes": 1e6}, {"flops": 1e6, "bytes": 1e9}]
    assert predicted_seconds(ops, FLOPS, BANDWIDTH) == pytest.approx(1e9 / FLOPS + 1e9 / BANDWIDTH)


def test_bad_sizes_are_refused_and_a_slider_redraws():
    with pytest.raises(ValueError, match="positive"):
        compute_roofline_view(0, 10, FLOPS, BANDWIDTH)
    box = build_roofline_widget(FLOPS, BANDWIDTH, d=256, tokens=1024)
    width = box.children[0].children[0]
    before = (box.children[1].value, box.children[2].value)
    width.value = 1024
    assert (box.children[1].value, box.children[2].value) != before
