"""Tests of the chapter 2 widgets: compute functions against torch's dtypes, builders headless."""

import math

import matplotlib
import pytest
import torch

from minitrain.precision import FP16
from minitrain.widgets.ch02_precision import (
    build_float_explorer,
    build_loss_scale_widget,
    collect_gradients,
    compute_float_explorer,
    compute_gradient_histogram,
)

matplotlib.use("Agg")


def test_explorer_decodes_bits_like_torch():
    info = compute_float_explorer("fp16", bits=0x3C01)
    assert info["value"] == torch.tensor([0x3C01], dtype=torch.int16).view(torch.float16).item()
    assert info["bit_string"] == "0|01111|0000000001"
    assert (info["sign"], info["exponent"], info["mantissa"], info["kind"]) == (0, 15, 1, "normal")
    assert compute_float_explorer("fp8_e4m3", bits=0x7F)["kind"] == "nan"
    assert compute_float_explorer("fp8_e5m2", bits=0x7C)["kind"] == "inf"
    assert compute_float_explorer("bf16", bits=0x0001)["kind"] == "subnormal"


def test_explorer_rounds_a_typed_value_like_torch():
    info = compute_float_explorer("bf16", value=0.1)
    nearest = torch.tensor(0.1).to(torch.bfloat16).item()
    assert info["nearest"] == nearest
    lo, hi = info["neighbours"]
    assert lo < nearest < hi
    assert torch.tensor(lo).to(torch.bfloat16).item() == lo  # neighbours are representable
    assert torch.nextafter(torch.tensor(lo), torch.tensor(1.0)).to(torch.bfloat16).item() in (
        lo,
        nearest,
    )
    assert info["abs_error"] == abs(nearest - 0.1)
    assert math.isclose(info["rel_error"], abs(nearest - 0.1) / 0.1)


def test_explorer_rejects_bad_input():
    with pytest.raises(ValueError, match="fp7"):
        compute_float_explorer("fp7", bits=0)
    with pytest.raises(ValueError, match="exactly one"):
        compute_float_explorer("fp16")


def test_histogram_fractions_match_torch_fp16_cast():
    g = torch.Generator().manual_seed(0)
    grads = torch.randn(50_000, generator=g) * torch.exp2(
        torch.randint(-40, 0, (50_000,), generator=g).float()
    )
    for scale in (1.0, 2.0**10, 2.0**30):
        h = compute_gradient_histogram(grads, scale)
        cast = (grads * scale).to(torch.float16)
        assert h["flushed_fraction"] == (cast == 0).double().mean().item()
        assert h["overflow_fraction"] == cast.isinf().double().mean().item()
        assert sum(h["counts"]) == grads.numel()
    assert (
        compute_gradient_histogram(grads, 2.0**10)["flushed_fraction"]
        < compute_gradient_histogram(grads, 1.0)["flushed_fraction"]
    )


def test_collect_gradients_includes_activation_gradients():
    from minitrain.data import MarkovChainData
    from minitrain.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1))
    idx, tgt = MarkovChainData().get_batch(0, 2)
    grads = collect_gradients(model, idx, tgt)
    assert any("activation" in k for k in grads)
    ref = torch.autograd.grad(model.loss(idx, tgt), list(model.parameters()))
    for (name, _), r in zip(model.named_parameters(), ref):
        torch.testing.assert_close(grads[f"{name} (weight grad)"], r)


def test_float_explorer_widget_reacts_to_value_format_and_bits():
    widget = build_float_explorer("fp16", 1.0)
    (fmt_box, number), bit_row, status = (
        widget.children[0].children,
        widget.children[1],
        widget.children[2],
    )
    assert len(bit_row.children) == 16 and "1.0" in status.value
    number.value = 0.1
    assert "0.0999755859375" in status.value  # fp16's nearest to 0.1
    fmt_box.value = "fp8_e4m3"
    assert len(bit_row.children) == 8 and "0.1015625" in status.value
    bit_row.children[0].value = not bit_row.children[0].value  # flip the sign bit
    assert "-0.1015625" in status.value


def test_loss_scale_widget_updates_fraction():
    g = torch.Generator().manual_seed(0)
    grads = torch.randn(5000, generator=g) * 1e-8
    widget = build_loss_scale_widget(grads, log2_scale=0)
    slider, status = widget.children[0].children[0], widget.children[1]
    before = status.value
    slider.value = 16
    assert status.value != before
    assert (
        f"{compute_gradient_histogram(grads, 2.0**16, FP16)['flushed_fraction']:.2%}"
        in status.value
    )


def test_float_explorer_labels_every_bit():
    from minitrain.precision import FP16
    from minitrain.widgets.ch02_precision import bit_fields

    assert bit_fields(FP16)[:2] == [("sign", 15), ("exponent", 14)]
    assert bit_fields(FP16)[5:7] == [("exponent", 10), ("mantissa", 9)] and bit_fields(FP16)[-1] == ("mantissa", 0)
    widget = build_float_explorer("fp16", 1.0)
    bit_row, status = widget.children[1], widget.children[2]
    assert [b.description for b in bit_row.children] == [str(i) for i in range(15, -1, -1)]
    assert bit_row.children[0].tooltip == "sign bit 15"
    assert bit_row.children[1].tooltip == "exponent bit 14" and bit_row.children[-1].tooltip == "mantissa bit 0"
    assert "sign" in status.value and "exponent" in status.value and "mantissa" in status.value

