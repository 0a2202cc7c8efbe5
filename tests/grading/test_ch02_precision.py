"""Graded tests of chapter 2: float formats and loss scaling, checked against torch's dtypes,
Python's exact rounding and torch.amp.GradScaler."""

import math
from fractions import Fraction

import pytest
import torch
from torch import nn


def _torch_values(dtype, bits):
    raw = torch.arange(2**bits, dtype=torch.int32)
    if bits == 16:
        return (raw - (raw >= 2**15).int() * 2**16).to(torch.int16).view(dtype).tolist()
    return raw.to(torch.uint8).view(dtype).float().tolist()


def _same(a, b):
    return (math.isnan(a) and math.isnan(b)) or (
        a == b and math.copysign(1, a) == math.copysign(1, b)
    )


@pytest.mark.exercise("FloatFormat.decode", points=1)
@pytest.mark.parametrize("name", ["FP16", "BF16", "FP8_E4M3", "FP8_E5M2"])
def test_decode_every_bit_pattern(name):
    from minitrain import precision

    fmt = getattr(precision, name)
    expected = _torch_values(fmt.torch_dtype, fmt.bits)
    wrong = []  # up to three wrong patterns: their pattern (e.g. the subnormals) names the rule
    for bits, want in enumerate(expected):
        got = fmt.decode(bits)
        if not _same(got, want):
            wrong.append(f"{name}.decode({bits:#0{fmt.bits // 4 + 2}x}) gave {got}, but torch "
                         f"reads that bit pattern as {want}")
            if len(wrong) == 3:
                break
    assert not wrong, "FloatFormat.decode: " + "; ".join(wrong)


@pytest.mark.exercise("round_significand", points=3)
def test_round_significand_against_exact_rounding():
    from minitrain.precision import round_significand

    g = torch.Generator().manual_seed(0)
    sig = torch.randint(0, 2**53, (2000,), generator=g)
    shift = torch.randint(1, 30, (2000,), generator=g)
    # exact ties: low bits exactly 100...0, with odd and even kept parts
    sig[:500] = ((sig[:500] >> shift[:500]) << shift[:500]) | (1 << (shift[:500] - 1))
    got = round_significand(sig.clone(), shift.clone())
    for s, k, q in zip(sig.tolist(), shift.tolist(), got.tolist()):
        want = round(Fraction(s, 2**k))  # Python rounds Fractions half to even
        assert q == want, f"round_significand({s:#b}, shift={k}) gave {q}, expected {want}"


@pytest.mark.exercise("round_significand", points=2)
def test_fp16_round_matches_torch_cast():
    from minitrain.precision import FP16

    g = torch.Generator().manual_seed(1)
    x = torch.randn(200_000, generator=g) * torch.exp2(
        torch.randint(-28, 18, (200_000,), generator=g).float()
    )
    got, want = FP16.round(x), x.to(torch.float16).float()
    bad = ~((got == want) | (got.isnan() & want.isnan()))
    assert not bad.any(), (
        f"FP16.round differs from torch's fp16 cast on {int(bad.sum())} values, e.g. "
        f"{x[bad][0].item()!r} -> {got[bad][0].item()!r}, torch gives {want[bad][0].item()!r}"
    )


def _scaler_run(make_scaler):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = make_scaler()
    g = torch.Generator().manual_seed(1)
    scales = []
    for step in range(20):
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)
        loss = ((model(x) - y) ** 2).mean()
        if step in (3, 4, 12):  # injected overflow
            loss = loss * math.inf
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in model.parameters()]


@pytest.mark.exercise("DynamicLossScaler.update", points=3)
@pytest.mark.parametrize(
    "kw",
    [
        dict(init_scale=2.0**8, growth_interval=3),
        dict(init_scale=100.0, growth_factor=1.5, backoff_factor=0.25, growth_interval=2),
    ],
    ids=["default-factors", "other-factors"],
)
def test_scaler_update_matches_grad_scaler(kw):
    from minitrain.precision import DynamicLossScaler

    ours, params = _scaler_run(lambda: DynamicLossScaler(**kw))
    ref, ref_params = _scaler_run(lambda: torch.amp.GradScaler("cpu", **kw))
    for step, (a, b) in enumerate(zip(ours, ref)):
        assert a == b, (
            f"after step {step} your scale is {a}, torch's GradScaler has {b} (overflow at steps 3, 4, 12)"
        )
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params)), (
        "the scale sequence matches but the parameters differ from GradScaler's run"
    )


@pytest.mark.exercise("MasterWeightOptimizer.step", points=2)
def test_master_step_is_fp32_update_then_copy():
    from minitrain.precision import MasterWeightOptimizer

    torch.manual_seed(0)
    model = nn.Linear(5, 3).to(torch.bfloat16)
    reference = [p.detach().float().clone() for p in model.parameters()]
    opt = MasterWeightOptimizer(model, torch.optim.SGD, lr=0.01)
    for step in range(3):
        x = torch.randn(4, 5).to(torch.bfloat16)
        loss = model(x).float().pow(2).mean()
        grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        loss.backward()
        opt.step()
        opt.zero_grad()
        for i, (p, g) in enumerate(zip(model.parameters(), grads)):
            reference[i] = torch.add(reference[i], g.float(), alpha=-0.01)
            assert torch.equal(opt.master_params[i], reference[i]), (
                f"MasterWeightOptimizer.step, step {step}: master weight {i} is not the fp32 "
                f"SGD update of the previous master"
            )
            assert torch.equal(p.detach(), reference[i].to(torch.bfloat16)), (
                f"MasterWeightOptimizer.step, step {step}: model parameter {i} is not its "
                f"master copy rounded to bf16"
            )


@pytest.mark.exercise("MasterWeightOptimizer.step", points=2)
def test_master_weights_keep_tiny_updates():
    from minitrain.precision import MasterWeightOptimizer

    model = nn.Linear(1, 1, bias=False).to(torch.float16)
    nn.init.ones_(model.weight)
    opt = MasterWeightOptimizer(model, torch.optim.SGD, lr=1e-4)
    for _ in range(20):
        model(torch.ones(1, 1, dtype=torch.float16)).sum().backward()  # gradient 1
        opt.step()
        opt.zero_grad()
    master = opt.master_params[0].item()
    assert abs(master - (1 - 20e-4)) < 1e-6, (
        f"MasterWeightOptimizer.step: after 20 updates of -1e-4 the fp32 master should be 0.998, got {master}"
    )
    assert model.weight.item() == float(torch.tensor(master).half()), (
        f"MasterWeightOptimizer.step: after step the fp16 weight is {model.weight.item()}; it should be the fp32 master "
        f"{master} rounded to fp16, {float(torch.tensor(master).half())} (copy the master back)"
    )
