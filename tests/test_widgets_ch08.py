"""The chapter 8 widget: its heat-map counts come from a real forward pass (they add up to
the routed assignments and match a direct forward of the layer), capacity drops what the
formula says, and the headless widget reacts to its controls."""

import math

import pytest
import torch

from minitrain.widgets.ch08_moe import build_moe_widget, compute_routing_view


def test_view_counts_come_from_the_forward_pass():
    view = compute_routing_view("aux_loss", 0.01, 1, None, world=2, steps=3)
    tokens_per_rank = 16 // 2 * 32
    assert [sum(row) for row in view["counts"]] == [tokens_per_rank] * 2  # k = 1, no drops
    assert view["dropped_fraction"] == 0.0
    total = torch.tensor(view["counts"]).sum(0).float()
    assert view["imbalance"] == pytest.approx(float(total.max() / total.mean()))
    capped = compute_routing_view("aux_loss", 0.01, 1, 1.0, world=2, steps=3)
    cap = math.ceil(1.0 * 1 * tokens_per_rank / 8)
    assert capped["capacity"] == cap
    assert all(c <= cap for row in capped["counts"] for c in row)
    kept = sum(min(c, cap) for row in view["counts"] for c in row)
    assert capped["dropped_fraction"] == pytest.approx(1 - kept / (2 * tokens_per_rank))
    with pytest.raises(ValueError, match="'sideways'"):
        compute_routing_view("sideways")


def test_widget_updates_headlessly():
    box = build_moe_widget(world=2, steps=3)
    method, (weight, capacity), top_k, status, image = (box.children[0], box.children[1].children,
                                                        box.children[2], box.children[3],
                                                        box.children[4])
    before, picture = status.value, bytes(image.value)
    assert "aux_loss" in before and "dropped 0.0 %" in before
    capacity.value = 0.5
    assert "capacity factor 0.5" in status.value and "dropped 0.0 %" not in status.value
    top_k.value = 2
    assert "top-2" in status.value
    weight.value = 0.1
    assert "(weight 0.1)" in status.value
    method.value = "bias"
    assert status.value.startswith("bias") and bytes(image.value) != picture
