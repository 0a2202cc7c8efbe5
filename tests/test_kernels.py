"""Chapter 12's hand-fused operators against torch's own: the norms (PyTorch and Triton under
the interpreter), the chunked linear cross-entropy, and the bytes each keeps — measured with
saved-tensor hooks and the allocation counter, against the formulas."""

import pytest
import torch
import torch.nn.functional as F

from minitrain.kernels import (
    chunked_linear_cross_entropy,
    fused_layer_norm,
    fused_rms_norm,
    loss_peak_bytes,
    norm_saved_bytes,
)
from minitrain.memory import LiveAllocations, saved_activation_bytes

TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-12}
WIDTH = 48  # not a power of two: the Triton kernels' padding columns must stay out of it


def _close(a, b, tol):
    """|a - b| <= tol relative to the reference's scale (a weight gradient sums many rows)."""
    return (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


def _norm_inputs(dtype, shape=(3, 5, WIDTH)):
    gen = torch.Generator(device="cpu").manual_seed(0)
    make = lambda *s: torch.randn(*s, generator=gen, dtype=dtype, device="cpu")  # noqa: E731
    x, w, b, g = make(*shape), 1 + 0.1 * make(shape[-1]), make(shape[-1]), make(*shape)
    return x.requires_grad_(), w.requires_grad_(), b.requires_grad_(), g


CASES = [("torch", torch.float32), ("torch", torch.float64), ("triton", torch.float32)]


@pytest.mark.parametrize("backend,dtype", CASES)
def test_fused_rms_norm_equals_torch(backend, dtype):
    x, w, _, g = _norm_inputs(dtype)
    ours, ref = fused_rms_norm(x, w, 1e-6, backend=backend), F.rms_norm(x, (WIDTH,), w, 1e-6)
    assert _close(ours, ref, TOLERANCE[dtype])
    for a, b in zip(torch.autograd.grad(ours, [x, w], g), torch.autograd.grad(ref, [x, w], g)):
        assert _close(a, b, TOLERANCE[dtype])


@pytest.mark.parametrize("backend,dtype", CASES)
def test_fused_layer_norm_equals_torch(backend, dtype):
    x, w, b, g = _norm_inputs(dtype)
    ours = fused_layer_norm(x, w, b, 1e-5, backend=backend)
    ref = F.layer_norm(x, (WIDTH,), w, b, 1e-5)
    assert _close(ours, ref, TOLERANCE[dtype])
    grads = zip(torch.autograd.grad(ours, [x, w, b], g), torch.autograd.grad(ref, [x, w, b], g))
    for a, r in grads:
        assert _close(a, r, TOLERANCE[dtype])


@pytest.mark.parametrize("backend,dtype", CASES)
def test_a_fused_norm_saves_its_input_and_one_statistic_per_row(backend, dtype):
    x, w, b, _ = _norm_inputs(dtype)
    rms = saved_activation_bytes(lambda: fused_rms_norm(x, w, backend=backend), exclude=[w])
    layer = saved_activation_bytes(lambda: fused_layer_norm(x, w, b, backend=backend),
                                   exclude=[w, b])
    assert rms == norm_saved_bytes(x.shape, dtype, "rms")
    assert layer == norm_saved_bytes(x.shape, dtype, "layer")
    unfused = saved_activation_bytes(
        lambda: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w, exclude=[w])
    assert unfused >= rms + x.numel() * x.element_size()  # one more copy of x: what fusing saves


def test_the_triton_norms_refuse_float64_and_mixed_devices():
    x, w, b, _ = _norm_inputs(torch.float64)
    with pytest.raises(TypeError, match="float64"):
        fused_rms_norm(x, w, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        fused_layer_norm(x, w, b, backend="cuda")
    with pytest.raises(ValueError, match="weight has shape"):
        fused_rms_norm(x, w[:-1])


def _loss_inputs(tokens, vocab, d, dtype=torch.float32):
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(tokens, d, generator=gen, dtype=dtype, device="cpu").requires_grad_()
    w = (0.1 * torch.randn(vocab, d, generator=gen, dtype=dtype, device="cpu")).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), generator=gen, device="cpu")
    y[::7] = -100  # some tokens are not counted (padding), as F.cross_entropy allows
    return x, w, y


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("chunk", [1, 37, 64, 10_000])
def test_chunked_linear_cross_entropy_equals_the_unfused_loss(dtype, tol, chunk):
    x, w, y = _loss_inputs(100, 300, 16, dtype)
    ours = chunked_linear_cross_entropy(x, w, y, chunk_size=chunk)
    ref = F.cross_entropy(x @ w.T, y)
    assert abs(ours.item() - ref.item()) <= tol
    for a, b in zip(torch.autograd.grad(ours, [x, w]), torch.autograd.grad(ref, [x, w])):
        assert (a - b).abs().max().item() <= tol


def test_the_chunked_loss_holds_one_chunk_of_logits_at_vocabulary_4096():
    tokens, vocab, d, chunk = 512, 4096, 64, 64
    x, w, y = _loss_inputs(tokens, vocab, d)
    peaks = {}
    for name, loss_fn in {"unfused": lambda: F.cross_entropy(x @ w.T, y),
                          "chunked": lambda: chunked_linear_cross_entropy(x, w, y, chunk)}.items():
        with LiveAllocations() as mem:
            torch.autograd.grad(loss_fn(), [x, w])
        peaks[name] = mem.peak
    formula = {"unfused": loss_peak_bytes(tokens, vocab, d, None),
               "chunked": loss_peak_bytes(tokens, vocab, d, chunk)}
    assert peaks["chunked"] <= formula["chunked"]
    assert peaks["unfused"] / peaks["chunked"] >= formula["unfused"] / formula["chunked"] > 5
    assert peaks["chunked"] < tokens * vocab * 4  # never the logits of every token


def test_the_chunked_loss_refuses_bad_shapes():
    x, w, y = _loss_inputs(10, 20, 4)
    with pytest.raises(ValueError, match="must be"):
        chunked_linear_cross_entropy(x, w.T, y)
    with pytest.raises(ValueError, match="targets"):
        chunked_linear_cross_entropy(x, w, y[:-1])
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_linear_cross_entropy(x, w, y, chunk_size=0)


def test_live_allocations_counts_temporaries_and_their_release():
    before = torch.ones(500, device="cpu")
    with LiveAllocations() as mem:
        earlier = before[:10]  # a view of a storage allocated before: not counted
        a = torch.ones(1000, device="cpu")  # 4,000 bytes
        b = a * 2  # 4,000 more, a temporary
        view = b[:10]  # a view: no new storage
        del b
        assert mem.live == 8000  # the view keeps b's storage alive
        del view
        c = a.add_(1)  # in place: no new storage
    assert mem.peak == 8000 and mem.live == 4000 and c is a and earlier.numel() == 10
