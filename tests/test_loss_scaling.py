"""minitrain.precision (loss scaling, master weights, fp8) against torch: GradScaler side by side, _scaled_mm, exact formulas."""

import copy
import math

import pytest
import torch
from torch import nn

from minitrain.memory import bytes_per_parameter
from minitrain.precision import (
    BF16,
    FP8_E4M3,
    FP8_E5M2,
    FP16,
    FP32,
    DynamicLossScaler,
    MasterWeightOptimizer,
)
from minitrain.precision.fp8 import (
    DelayedScaling,
    QuantizedLinear,
    amax_scale,
    quantize,
    quantize_linears,
)


def test_contract_names_are_exported_by_precision():
    import minitrain.precision as p
    from minitrain.precision import loss_scaling, master_weights

    assert p.DynamicLossScaler is loss_scaling.DynamicLossScaler
    assert p.MasterWeightOptimizer is master_weights.MasterWeightOptimizer
    for name in ("FloatFormat", "FP32", "FP16", "BF16", "FP8_E4M3", "FP8_E5M2"):
        assert name in vars(p), name  # grading patches modules through vars()


def _train_side_by_side(
    make_scaler, dtype=torch.float32, steps=24, optimizer=torch.optim.SGD, clip_every=5, **kw
):
    """A small MLP trained with `make_scaler()`; overflow injected at steps 4, 5 (inf) and
    11 (NaN in one gradient). Returns the scale after each update, which steps changed no
    parameter, and the final parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(dtype)
    if dtype == torch.float32:
        opt = optimizer(model.parameters(), lr=0.05, **kw)
    else:
        opt = MasterWeightOptimizer(model, optimizer, lr=0.05, **kw)
    scaler = make_scaler()
    g = torch.Generator().manual_seed(1)
    scales, skipped = [], []
    for step in range(steps):
        x, y = torch.randn(4, 8, generator=g).to(dtype), torch.randn(4, 1, generator=g).to(dtype)
        loss = ((model(x) - y) ** 2).mean()
        if step in (4, 5):
            loss = loss * math.inf
        opt.zero_grad()
        scaler.scale(loss).backward()
        if step == 11:
            opt.param_groups[0]["params"][0].grad[0, 0] = math.nan
        if step % clip_every == 0:  # unscale_ early, as gradient clipping does
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(opt.param_groups[0]["params"], 1.0)
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(all(torch.equal(b, p) for b, p in zip(before, model.parameters())))
    return scales, skipped, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "kw",
    [
        dict(init_scale=2.0**10, growth_interval=3),
        dict(init_scale=1000.0, growth_factor=1.5, backoff_factor=0.3, growth_interval=2),
    ],
    ids=["powers-of-two", "odd-factors"],
)
@pytest.mark.parametrize("opt", [torch.optim.SGD, torch.optim.Adam], ids=["sgd", "adam"])
def test_dynamic_scaler_matches_grad_scaler(kw, opt):
    ours = _train_side_by_side(lambda: DynamicLossScaler(**kw), optimizer=opt)
    ref = _train_side_by_side(lambda: torch.amp.GradScaler("cpu", **kw), optimizer=opt)
    assert ours[0] == ref[0], "scale sequences differ"
    assert ours[1] == ref[1], "skipped steps differ"
    assert [4, 5, 11] == [i for i, s in enumerate(ref[1]) if s]  # the injected overflows
    assert len(set(ref[0])) > 2, "the run should both grow and back off"
    assert all(torch.equal(a, b) for a, b in zip(ours[2], ref[2])), "parameters differ"


def test_dynamic_scaler_with_master_weights_matches_grad_scaler():
    kw = dict(init_scale=2.0**12, growth_interval=4)
    ours = _train_side_by_side(lambda: DynamicLossScaler(**kw), dtype=torch.float16)
    ref = _train_side_by_side(lambda: torch.amp.GradScaler("cpu", **kw), dtype=torch.float16)
    assert ours[0] == ref[0] and ours[1] == ref[1]
    assert all(torch.equal(a, b) for a, b in zip(ours[2], ref[2]))


def test_scaler_misuse_raises_like_grad_scaler():
    for make in (lambda: DynamicLossScaler(), lambda: torch.amp.GradScaler("cpu")):
        w = nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([w], lr=0.1)
        scaler = make()
        scaler.scale(w.sum()).backward()
        scaler.unscale_(opt)
        with pytest.raises(RuntimeError, match="already been called"):
            scaler.unscale_(opt)
        scaler.step(opt)
        with pytest.raises(RuntimeError, match="already been called"):
            scaler.step(opt)
        scaler.update()
    with pytest.raises(RuntimeError, match="No inf checks"):
        DynamicLossScaler().update()
    with pytest.raises(ValueError, match="growth_factor"):
        DynamicLossScaler(growth_factor=0.5)
    with pytest.raises(ValueError, match="fp16"):
        w = nn.Parameter(torch.ones(2, dtype=torch.float16))
        w.grad = torch.ones(2, dtype=torch.float16)
        DynamicLossScaler().unscale_(torch.optim.SGD([w], lr=0.1))


def test_master_weight_step_is_fp32_sgd_then_rounding():
    torch.manual_seed(0)
    model = nn.Linear(6, 3).to(torch.bfloat16)
    fp32_copy = [p.detach().float().clone() for p in model.parameters()]
    opt = MasterWeightOptimizer(model, torch.optim.SGD, lr=0.01)
    for step in range(3):
        x = torch.randn(5, 6).to(torch.bfloat16)
        loss = model(x).float().pow(2).mean()
        grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        loss.backward()
        opt.step()
        opt.zero_grad()
        for i, (p, g) in enumerate(zip(model.parameters(), grads)):
            fp32_copy[i] = torch.add(fp32_copy[i], g.float(), alpha=-0.01)  # SGD, in fp32
            assert torch.equal(opt.master_params[i], fp32_copy[i]), f"master {i}, step {step}"
            assert torch.equal(p, fp32_copy[i].to(torch.bfloat16)), f"param {i}, step {step}"


def test_master_weights_keep_updates_smaller_than_half_an_ulp():
    # w = 1 in fp16 has ulp 2**-10; an update of 1e-4 is below half of it (4.9e-4).
    pure = nn.Parameter(torch.ones(1, dtype=torch.float16))
    model = nn.Linear(1, 1, bias=False).to(torch.float16)
    nn.init.ones_(model.weight)
    opt = MasterWeightOptimizer(model, torch.optim.SGD, lr=1e-4)
    pure_opt = torch.optim.SGD([pure], lr=1e-4)
    for _ in range(10):
        pure.grad = torch.ones(1, dtype=torch.float16)
        pure_opt.step()
        model(torch.ones(1, 1, dtype=torch.float16)).sum().backward()  # gradient exactly 1
        opt.step()
        opt.zero_grad()
    assert pure.item() == 1.0  # every update vanished
    expected = 1.0 - 10 * 1e-4
    assert abs(opt.master_params[0].item() - expected) < 1e-6
    assert model.weight.item() == FP16.round(torch.tensor([expected], dtype=torch.float64)).item()


def test_master_gradients_accumulate_in_fp32():
    model = nn.Linear(2, 1, bias=False).to(torch.float16)
    opt = MasterWeightOptimizer(model, torch.optim.SGD, lr=0.1)
    x = torch.tensor([[1.0, 2.0]], dtype=torch.float16)
    model(x).sum().backward()
    model(x).sum().backward()
    assert model.weight.grad is None, "the fp16 gradient should have been moved to the master"
    assert opt.master_params[0].grad.dtype == torch.float32
    assert opt.master_params[0].grad.tolist() == [[2.0, 4.0]]


def test_amax_scaling_fills_the_range():
    x = torch.randn(1000) * 3e-3
    for fmt in (FP8_E4M3, FP8_E5M2):
        s = amax_scale(x.abs().max(), fmt)
        q = quantize(x, fmt, s)
        assert q.abs().max().item() == fmt.max
        assert torch.equal(q, fmt.round(q)), "quantized values must be representable"
    assert amax_scale(torch.tensor(0.0), FP8_E4M3).item() == 1.0


def test_delayed_scaling_uses_the_history_maximum():
    d = DelayedScaling(FP8_E4M3, history_len=2)
    assert d(torch.tensor([2.0])).item() == 224.0  # empty history: current amax
    assert d(torch.tensor([4.0])).item() == 224.0  # from amax 2 of the previous step
    assert d(torch.tensor([1.0])).item() == 112.0  # history [2, 4] -> 4
    assert d(torch.tensor([1.0])).item() == 112.0  # history [4, 1] -> 4
    assert d(torch.tensor([1.0])).item() == 448.0  # history [1, 1] -> 1
    with pytest.raises(ValueError, match="history_len"):
        DelayedScaling(FP8_E4M3, history_len=0)


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_fp8_linear_matches_torch_scaled_mm(scaling):
    torch.manual_seed(0)
    layer = QuantizedLinear(48, 64, bias=False, scaling=scaling)
    x = torch.randn(32, 48, requires_grad=True)
    g = torch.randn(32, 64) * 1e-3
    layer(x).backward(g)  # fills the delayed history
    x.grad, layer.weight.grad = None, None
    y = layer(x)
    y.backward(g)
    sx, sw, sg = (
        amax_scale(t.abs().max(), f)
        for t, f in ((x, FP8_E4M3), (layer.weight, FP8_E4M3), (g, FP8_E5M2))
    )
    x8 = quantize(x.detach(), FP8_E4M3, sx).to(torch.float8_e4m3fn)
    w8 = quantize(layer.weight.detach(), FP8_E4M3, sw).to(torch.float8_e4m3fn)
    g8 = quantize(g, FP8_E5M2, sg).to(torch.float8_e5m2)
    col = lambda t: t.t().contiguous().t()  # _scaled_mm wants its second operand column-major
    y_ref = torch._scaled_mm(x8, w8.t(), scale_a=1 / sx, scale_b=1 / sw, out_dtype=torch.float32)
    gx_ref = torch._scaled_mm(g8, col(w8), scale_a=1 / sg, scale_b=1 / sw, out_dtype=torch.float32)
    gw_ref = torch._scaled_mm(
        g8.t().contiguous(), col(x8), scale_a=1 / sg, scale_b=1 / sx, out_dtype=torch.float32
    )
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, gx_ref, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(layer.weight.grad, gw_ref, rtol=1e-5, atol=1e-8)


def test_quantized_linear_in_fp32_is_nn_linear():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 2))
    ref = copy.deepcopy(model)
    quantize_linears(model, exclude=("2",), forward_format=FP32, backward_format=FP32, scaling=None)
    assert isinstance(model[0], QuantizedLinear) and type(model[2]) is nn.Linear
    x = torch.randn(3, 5)
    model(x).sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(model(x), ref(x))
    torch.testing.assert_close(model[0].weight.grad, ref[0].weight.grad)
    torch.testing.assert_close(model[0].bias.grad, ref[0].bias.grad)


def test_bf16_linear_rounds_operands_to_bf16():
    layer = QuantizedLinear(
        4, 3, bias=False, forward_format=BF16, backward_format=BF16, scaling=None
    )
    x = torch.randn(2, 4)
    expected = BF16.round(x) @ BF16.round(layer.weight.detach()).t()
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)


def test_bytes_per_parameter_agrees_with_memory_module():
    from minitrain import memory

    n = 1_000_003
    for recipe in ("fp32", "mixed"):
        est = memory.estimate_training_memory(n, recipe)
        ours = bytes_per_parameter(recipe)
        assert {k: v * n for k, v in ours.items()} == est, recipe
    assert (
        bytes_per_parameter("fp32")["total"] == 16 and bytes_per_parameter("mixed")["total"] == 20
    )
    with pytest.raises(ValueError, match="fp64"):
        bytes_per_parameter("fp64")


def test_stale_delayed_scale_saturates_instead_of_overflowing():
    # amax history says 1, the tensor now reaches 40: x * scale overshoots max 40-fold.
    # Expected: clamp to the format's max (448 for E4M3, 57344 for E5M2, written out here),
    # then torch's own cast. E5M2's cast alone would give inf; FP8 recipes saturate.
    x = torch.tensor([40.0, -40.0, 1.5, -0.75, 0.0, 3.0])
    for fmt, dtype, largest in (
        (FP8_E4M3, torch.float8_e4m3fn, 448.0),
        (FP8_E5M2, torch.float8_e5m2, 57344.0),
    ):
        d = DelayedScaling(fmt, history_len=4)
        d(torch.tensor([1.0]))  # history [1]
        scale = d(x)  # stale: from amax 1
        assert scale.item() == largest
        expected = (x * scale).clamp(-largest, largest).to(dtype).float()
        got = quantize(x, fmt, scale)
        assert torch.isfinite(got).all(), f"{fmt.name}: {got.tolist()} overflowed"
        assert torch.equal(got, expected), f"{fmt.name}: {got.tolist()} != {expected.tolist()}"


def test_quantized_linear_gradient_saturates_when_its_amax_jumps():
    torch.manual_seed(0)
    layer = QuantizedLinear(4, 3, bias=False, scaling="delayed")
    x = torch.randn(2, 4, requires_grad=True)
    layer(x).backward(torch.full((2, 3), 1e-3))  # gradient history: amax 1e-3
    x.grad = None
    layer(x).backward(torch.full((2, 3), 1.0))  # 1000x larger: x * scale beyond E5M2's max
    assert torch.isfinite(x.grad).all() and torch.isfinite(layer.weight.grad).all()
    # saturated: every output gradient became 57344 / scale = 57344 / (57344 / 1e-3) = 1e-3
    w = layer.weight.detach()
    sw = 448.0 / w.abs().max()
    wq = (w * sw).to(torch.float8_e4m3fn).float() / sw
    torch.testing.assert_close(x.grad, torch.full((2, 3), 1e-3) @ wq, rtol=1e-5, atol=0)
