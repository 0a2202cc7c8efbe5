"""Graded tests of chapter 12: your RMSNorm backward against torch's own RMSNorm gradients."""

import pytest
import torch
import torch.nn.functional as F

from minitrain.kernels import RMSNormFunction


def _case(shape, dtype, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(*shape, generator=gen, device="cpu").to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen, device="cpu")).to(dtype).requires_grad_()
    g = torch.randn(*shape, generator=gen, device="cpu").to(dtype)
    return x, w, g


def _grads(fn, x, w, g):
    return torch.autograd.grad(fn(x, w), [x, w], g)


def _ours(x, w):
    return RMSNormFunction.apply(x, w, 1e-6)


def _torch(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, 1e-6)


@pytest.mark.exercise("RMSNormFunction.backward", points=3)
@pytest.mark.parametrize("shape", [(7, 24), (2, 5, 33)])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_rms_norm_backward_equals_torch(shape, dtype, tol):
    x, w, g = _case(shape, dtype)
    (dx, dw), (rx, rw) = _grads(_ours, x, w, g), _grads(_torch, x, w, g)
    assert dx.shape == x.shape and dw.shape == w.shape, (
        f"RMSNormFunction.backward returned gradients of shapes {tuple(dx.shape)} and "
        f"{tuple(dw.shape)}; x is {tuple(x.shape)}, the weight {tuple(w.shape)}")
    scale = max(1.0, rw.abs().max().item())
    assert (dw - rw).abs().max().item() <= tol * scale, (
        f"the weight's gradient differs from torch's by {(dw - rw).abs().max().item():.2e} "
        f"({dtype}): every row contributes to it")
    err = (dx - rx).abs().max().item()
    assert err <= tol, (
        f"the input's gradient differs from torch's by {err:.2e} ({dtype}); if only by a "
        "little less than the gradient itself, is the dependence of r on the row's x missing?")


@pytest.mark.exercise("RMSNormFunction.backward", points=1)
def test_rms_norm_backward_returns_the_inputs_dtypes_and_leaves_grad_out_alone():
    for dtype in (torch.float32, torch.float64):  # where r's dtype is grad_out's: no copy made
        x, w, g = _case((4, 16), dtype)
        before = g.clone()
        torch.autograd.grad(_ours(x, w), [x, w], g)
        assert torch.equal(g, before), (
            f"RMSNormFunction.backward modified grad_out in place ({dtype})")
    x, w, g = _case((4, 16), torch.bfloat16)
    before = g.clone()
    out = _ours(x, w)
    dx, dw = torch.autograd.grad(out, [x, w], g)
    assert dx.dtype == torch.bfloat16 and dw.dtype == torch.bfloat16, (
        f"RMSNormFunction.backward returned {dx.dtype} and {dw.dtype} for bf16 inputs: "
        "compute in r's dtype, return in the inputs' dtypes")
    assert torch.equal(g, before), "RMSNormFunction.backward modified grad_out in place"
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    rx, rw = _grads(_torch, x64, w64, g.double())
    # 16-bit results of fp32 arithmetic: off by the bf16 rounding of the result, not more
    assert (dx.double() - rx).abs().max().item() <= 2 ** -7 * max(1.0, rx.abs().max().item())
    assert (dw.double() - rw).abs().max().item() <= 2 ** -7 * max(1.0, rw.abs().max().item())
