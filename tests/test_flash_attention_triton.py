"""Chapter 9: the Triton kernels (run by Triton's interpreter on CPU tensors) against the
PyTorch tiles and scaled_dot_product_attention, forward and backward, causal or not, GQA.

CPU tensors run the kernels under Triton's interpreter, chosen per call from the device
(``triton_kernels.kernels_for``): nothing here sets TRITON_INTERPRET. The interpreter is
slow: sizes stay tiny.
Tolerance: fp32 within 2e-5 (+1e-5 relative) — tl.dot with input_precision="ieee".
"""

import pytest
import torch
import torch.nn.functional as F

from minitrain.flash_attention import FlashAttentionFunction
from minitrain.flash_attention.triton_kernels import FlashAttentionTritonFunction

FP32 = dict(atol=2e-5, rtol=1e-5)


def _run(fn, q, k, v, do, causal):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, causal)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape_q,shape_k", [((2, 37, 16), (2, 37, 16)),       # odd N, 3-D
                                             ((1, 4, 33, 8), (1, 2, 33, 8)),    # GQA
                                             ((1, 1, 1, 8), (1, 1, 1, 8)),      # N = 1
                                             ((1, 2, 40, 12), (1, 2, 40, 12))])  # d = 12
def test_triton_equals_tiles_and_sdpa(shape_q, shape_k, causal):
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(shape_q, generator=g), torch.randn(shape_k, generator=g), torch.randn(shape_k, generator=g)
    do = torch.randn(shape_q, generator=g)
    triton_res = _run(FlashAttentionTritonFunction.apply, q, k, v, do, causal)
    tiles_res = _run(FlashAttentionFunction.apply, q, k, v, do, causal)
    gqa = q.dim() == 4 and q.shape[1] != k.shape[1]
    sdpa_res = _run(lambda a, b, c, m: F.scaled_dot_product_attention(a, b, c, is_causal=m, enable_gqa=gqa),
                    q, k, v, do, causal)
    for name, t, p, s in zip(("out", "dq", "dk", "dv"), triton_res, tiles_res, sdpa_res):
        torch.testing.assert_close(t, p, **FP32, msg=lambda m, n=name: f"{n} vs tiles: {m}")
        torch.testing.assert_close(t, s, **FP32, msg=lambda m, n=name: f"{n} vs SDPA: {m}")


def test_triton_saves_the_logsumexp_and_handles_keys_longer_than_queries():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 20, 8, generator=g, requires_grad=True)
    k, v = torch.randn(2, 50, 8, generator=g), torch.randn(2, 50, 8, generator=g)
    out = FlashAttentionTritonFunction.apply(q, k, v, False)
    lse = [t for t in out.grad_fn.saved_tensors if t.shape == (2, 20)]
    assert len(lse) == 1
    ref = torch.logsumexp(q @ k.transpose(-2, -1) / 8 ** 0.5, dim=-1)
    torch.testing.assert_close(lse[0], ref, **FP32)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), **FP32)
