"""The fused FlashAttention tiles (issue 33) against torch's scaled_dot_product_attention.

Correctness only: speed is ``python -m minitrain.bench flash``'s ratio to SDPA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minitrain.flash_attention import flash_attention, fused_tiles, tiles
from minitrain.flash_attention.io_model import tiled_io

CASES = [  # q shape, k/v shape, causal, dtype, (block_q, block_k)
    ((2, 3, 70, 16), (2, 3, 70, 16), True, torch.float32, (16, 32)),
    ((1, 4, 45, 8), (1, 2, 45, 8), True, torch.float64, (8, 8)),  # GQA
    ((3, 37, 8), (3, 50, 8), False, torch.float64, (16, 16)),  # 3-D, Nq != Nk
    ((2, 6, 33, 8), (2, 3, 33, 8), False, torch.float32, (32, 8)),  # GQA, uneven blocks
    ((1, 2, 129, 64), (1, 2, 129, 64), True, torch.float32, (128, 128)),  # the defaults
]


def _sdpa(q, k, v, causal):
    if q.dim() == 4 and q.shape[1] != k.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


@pytest.mark.parametrize("shape_q, shape_kv, causal, dtype, block", CASES)
def test_fused_tiles_match_sdpa_forward_and_backward(shape_q, shape_kv, causal, dtype, block):
    torch.manual_seed(0)
    q = torch.randn(shape_q, dtype=dtype, device="cpu", requires_grad=True)
    k = torch.randn(shape_kv, dtype=dtype, device="cpu", requires_grad=True)
    v = torch.randn(shape_kv, dtype=dtype, device="cpu", requires_grad=True)
    grad = torch.randn(shape_q, dtype=dtype, device="cpu")
    out, lse = tiles.flash_attention_forward(q.detach(), k.detach(), v.detach(), causal, *block)
    ours = [out, *tiles.flash_attention_backward(q.detach(), k.detach(), v.detach(), out, lse,
                                                 grad, causal, *block)]
    ref = _sdpa(q, k, v, causal)
    ref.backward(grad)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-11)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, (ref, q.grad, k.grad, v.grad)):
        assert a.dtype == dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b.detach(), **tol, msg=f"{name} differs from SDPA's")
    scores = q.detach() @ k.detach().transpose(-2, -1) / q.shape[-1] ** 0.5 if q.shape[-3:-2] == k.shape[-3:-2] else None
    if scores is not None:  # the logsumexp, against its definition
        if causal:
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), **tol)


def test_fp32_runs_the_fused_tiles_and_bf16_the_readable_ones(monkeypatch):
    calls = []
    real_fwd, real_bwd = fused_tiles.fused_forward, fused_tiles.fused_backward
    monkeypatch.setattr(fused_tiles, "fused_forward", lambda *a: calls.append("f") or real_fwd(*a))
    monkeypatch.setattr(fused_tiles, "fused_backward", lambda *a: calls.append("b") or real_bwd(*a))
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(1, 2, 20, 8, dtype=dtype, device="cpu", requires_grad=True) for _ in range(3))
        flash_attention(q, k, v, True).sum().backward()
    assert calls == ["f", "b"]


@pytest.mark.parametrize("causal", [False, True])
def test_the_io_model_counts_what_the_fused_tiles_run(causal):
    log = tiles.TileLog()
    q, k, v = (torch.randn(1, 2, 50, 8, device="cpu") for _ in range(3))
    tiles.flash_attention_forward(q, k, v, causal, 16, 8, log)
    formula = tiled_io(50, 50, 8, 16, 8, causal)
    per_head = {key: log_value // 2 for key, log_value in (("reads", log.reads), ("writes", log.writes))}
    assert per_head["reads"] == formula["reads"] and per_head["writes"] == formula["writes"], (log.reads, formula)


@pytest.mark.parametrize("n", [16, 300])  # one block (views of the inputs) and several
def test_the_fused_backward_leaves_its_inputs_untouched(n):
    """Ring attention (chapter 10) calls the backward once per key block with the same global
    output and logsumexp: a tile that negated the caller's logsumexp in place (one block, a
    contiguous input is its own view) made every later block's gradient wrong."""
    from minitrain.flash_attention.tiles import flash_attention_backward, flash_attention_forward

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64) for _ in range(3))
    out, lse = flash_attention_forward(q, k, v, causal=True)
    grad = torch.randn_like(out)
    inputs = [t.clone() for t in (q, k, v, out, lse, grad)]
    first = flash_attention_backward(q, k, v, out, lse, grad, causal=True)
    for before, now in zip(inputs, (q, k, v, out, lse, grad)):
        assert torch.equal(before, now), "flash_attention_backward modified an input"
    again = flash_attention_backward(q, k, v, out, lse, grad, causal=True)
    for a, b in zip(first, again):
        assert torch.equal(a, b), "a second call on the same inputs gave another gradient"
