"""Chapter 9: FlashAttention in PyTorch tiles against scaled_dot_product_attention (the oracle),
the saved logsumexp against torch.logsumexp, IO and tile counts against io_model's formulas,
and the course GPT trained with it against naive attention.

Tolerances: fp32 outputs and gradients within 2e-5 absolute (+1e-5 relative) of SDPA — the
tiles sum in another order, a few fp32 rounding steps on values of order 1; bf16 within 3e-2
of the fp32 result on the same bf16 inputs (bf16 keeps 8 mantissa bits: 2^-8 ≈ 4e-3 per
rounding, a few roundings of values of order 1 in P, P V, dS); bf16/fp16 vs fp64 within 1.25x
SDPA's FlashAttention kernel's error (fp32 scores).
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from minitrain.data import get_batch
from minitrain.flash_attention import (
    FlashAttentionFunction,
    TileLog,
    flash_attention,
    flash_attention_backward,
    flash_attention_fn,
    flash_attention_forward,
    tiles,
)
from minitrain.flash_attention.io_model import (
    block_size_for_sram,
    causal_tiles,
    naive_io,
    theorem2_bound,
    tiled_io,
    tiled_io_for_sram,
)
from minitrain.flash_attention.measure import recorded_io, saved_bytes
from minitrain.model import GPT, GPTConfig, set_attention_fn

FP32 = dict(atol=2e-5, rtol=1e-5)


def _qkv(shape_q, shape_k, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, generator=g).to(dtype).requires_grad_() for s in (shape_q, shape_k, shape_k))
    return q, k, v, torch.randn(shape_q, generator=g).to(dtype)


def _reference(q, k, v, do, causal):
    gqa = q.dim() == 4 and q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


def _flash(q, k, v, do, causal, block_q=12, block_k=11):  # tiles that do not divide each other
    out = FlashAttentionFunction.apply(q, k, v, causal, block_q, block_k)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


CASES = [  # (q shape, k shape): odd N, N = 1, ragged tiles, d not a power of two, GQA, MQA
    ((2, 3, 37, 16), (2, 3, 37, 16)),
    ((1, 2, 1, 8), (1, 2, 1, 8)),
    ((1, 2, 50, 24), (1, 2, 50, 24)),
    ((2, 4, 33, 8), (2, 2, 33, 8)),
    ((1, 4, 20, 8), (1, 1, 20, 8)),
    ((3, 29, 8), (3, 29, 8)),
]


@pytest.fixture(params=["fused", "readable"])  # fp32 takes the fused tiles; here also the
def tile_path(request, monkeypatch):  # readable ones (the bf16 path, the exercises' solutions)
    if request.param == "readable":
        monkeypatch.setattr(tiles, "_fused", lambda *tensors: False)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shapes", CASES, ids=lambda s: f"{s[0]}-{s[1]}")
def test_matches_sdpa_fp32(shapes, causal, tile_path):
    q, k, v, do = _qkv(*shapes)
    for name, ours, ref in zip(("out", "dq", "dk", "dv"), _flash(q, k, v, do, causal),
                               _reference(q, k, v, do, causal)):
        torch.testing.assert_close(ours, ref, **FP32, msg=lambda m, n=name: f"{n}: {m}")


def test_keys_longer_than_queries_and_default_tiles():
    q, k, v, do = _qkv((1, 2, 20, 8), (1, 2, 150, 8))
    ours = flash_attention(q, k, v)
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v), **FP32)


def test_bf16_close_to_fp32_oracle():
    q, k, v, do = _qkv((1, 2, 33, 16), (1, 2, 33, 16), dtype=torch.bfloat16)
    ours = _flash(q, k, v, do, True)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = _reference(q32, k32, v32, do.float(), True)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert a.dtype == torch.bfloat16, name
        torch.testing.assert_close(a.float(), b, atol=3e-2, rtol=2e-2, msg=lambda m, n=name: f"{n}: {m}")


def _naive_fp64(q, k, v, do, causal):
    """out, dq, dk, dv of attention written out in fp64 on the same (16-bit) input values."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    out = torch.softmax(s, -1) @ v
    return (out, *torch.autograd.grad(out, (q, k, v), do.double()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_16_bit_scores_accumulate_in_fp32_as_accurate_as_sdpa(dtype, causal):
    # issue 40: the tiles rounded q_i k_j^T to bf16 before the fp32 softmax. vs fp64: as accurate
    # as SDPA's CPU FlashAttention kernel (fp32 scores; P, dS rounded as operands, as tensor cores
    # do). q, k of scale 2: a bf16 score costs 2^-9 |score| per probability (old: 2-4x SDPA's).
    q, k, v, do = _qkv((1, 2, 50, 32), (1, 2, 50, 32), dtype=dtype, seed=3)
    q, k = (t.detach().mul(2).requires_grad_() for t in (q, k))  # exact: a power of two
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        sdpa = _reference(q, k, v, do, causal)
    ours = _flash(q, k, v, do, causal, 16, 16)
    assert [t.dtype for t in ours] == [dtype] * 4  # returned in the input dtype
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), ours, sdpa, _naive_fp64(q, k, v, do, causal)):
        # ||x - exact|| / ||exact||: stabler than the largest of a few thousand errors
        e, e_sdpa = (((x.double() - c).norm() / c.norm()).item() for x in (a, b))
        assert e <= 1.25 * e_sdpa, f"{dtype} {name}: relative error {e:.3g} vs fp64, SDPA's {e_sdpa:.3g}"


@pytest.mark.parametrize("tile_path", ["readable"], indirect=True)
def test_readable_tiles_keep_fp64_in_fp64(tile_path):
    # fp64 takes the fused tiles: here the readable ones must stay fp64 too, never pass fp32
    q, k, v, do = _qkv((1, 2, 21, 8), (1, 2, 21, 8), dtype=torch.float64)
    ours = _flash(q, k, v, do, True, 8, 5)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, _naive_fp64(q, k, v, do, True)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def _scores_lse(q, k, causal):  # the oracle's logsumexp, written out
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return torch.logsumexp(s, dim=-1)


@pytest.mark.parametrize("causal", [False, True])
def test_saved_tensors_hold_one_logsumexp_of_shape_batch_n(causal):
    # the layout a public assignment's tests look for: 3-D (batch, n, d) inputs, exactly one
    # saved tensor of shape (batch, n), equal to the logsumexp of the scaled scores
    q, k, v, do = _qkv((4, 128, 64), (4, 128, 64))
    out = FlashAttentionFunction.apply(q, k, v, causal)
    lse = [t for t in out.grad_fn.saved_tensors if t.shape == (4, 128)]
    assert len(lse) == 1, [tuple(t.shape) for t in out.grad_fn.saved_tensors]
    torch.testing.assert_close(lse[0], _scores_lse(q, k, causal), **FP32)
    out.backward(do)
    ref = _reference(*(t.detach().requires_grad_() for t in (q, k, v)), do, causal)
    torch.testing.assert_close(q.grad, ref[1], **FP32)


def test_backward_with_global_out_and_lse_gives_each_key_blocks_share(tile_path):
    # ring attention (chapter 10): each rank holds a key block; with the GLOBAL output and
    # logsumexp, the blocks' dq add up and their dk, dv are the global ones' slices
    q, k, v, do = _qkv((1, 2, 24, 8), (1, 2, 24, 8))
    out, dq_ref, dk_ref, dv_ref = _reference(q, k, v, do, True)
    lse = _scores_lse(q, k, True)
    # the forward's pieces combine to the global output and logsumexp
    q1, q0 = q[..., 12:, :], q[..., :12, :]
    o_diag, l_diag = flash_attention_forward(q1, k[..., 12:, :], v[..., 12:, :], True, 8, 8)
    o_past, l_past = flash_attention_forward(q1, k[..., :12, :], v[..., :12, :], False, 8, 8)
    l_all = torch.logaddexp(l_diag, l_past)
    o_all = torch.exp(l_diag - l_all)[..., None] * o_diag + torch.exp(l_past - l_all)[..., None] * o_past
    torch.testing.assert_close(l_all, lse[..., 12:], **FP32)
    torch.testing.assert_close(o_all, out[..., 12:, :], **FP32)
    # backward: rows 12.. get the diagonal block (causal) and the past block (not causal)
    args = (out[..., 12:, :].detach(), lse[..., 12:].detach(), do[..., 12:, :])
    dq_d, dk_d, dv_d = flash_attention_backward(q1, k[..., 12:, :], v[..., 12:, :], *args, True, 8, 8)
    dq_p, dk_p, dv_p = flash_attention_backward(q1, k[..., :12, :], v[..., :12, :], *args, False, 8, 8)
    dq_0, dk_0, dv_0 = flash_attention_backward(q0, k[..., :12, :], v[..., :12, :], out[..., :12, :].detach(),
                                                lse[..., :12].detach(), do[..., :12, :], True, 8, 8)
    torch.testing.assert_close(dq_d + dq_p, dq_ref[..., 12:, :], **FP32)
    torch.testing.assert_close(dq_0, dq_ref[..., :12, :], **FP32)
    torch.testing.assert_close(dk_d, dk_ref[..., 12:, :], **FP32)
    torch.testing.assert_close(dv_d, dv_ref[..., 12:, :], **FP32)
    torch.testing.assert_close(dk_p + dk_0, dk_ref[..., :12, :], **FP32)
    torch.testing.assert_close(dv_p + dv_0, dv_ref[..., :12, :], **FP32)


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_never_creates_an_n_by_n_tensor():
    n, d, block = 96, 8, 16
    q, k, v, do = _qkv((n, d), (n, d))
    with _LargestTensor() as mode:
        out = FlashAttentionFunction.apply(q, k, v, True, block, block)
        out.backward(do)
    assert mode.largest <= n * d, f"largest tensor {mode.largest} elements (N*N = {n * n})"


def test_saved_bytes_linear_in_n_naive_quadratic():
    rows = [saved_bytes(n, d=16, heads=2) for n in (32, 64, 128)]
    for r in rows:
        assert r["flash"] == r["flash_formula"] and r["naive"] == r["naive_formula"], r
    assert rows[2]["flash"] == 4 * rows[0]["flash"]  # O(N d): x4 for N x4
    assert rows[2]["naive"] > 8 * rows[0]["naive"]  # O(N^2) dominates


@pytest.mark.parametrize("n_q,n_k,bq,bk,causal", [(37, 37, 8, 16, True), (100, 70, 32, 16, False),
                                                   (64, 64, 16, 16, True), (1, 1, 16, 16, True)])
def test_recorded_io_and_tiles_equal_the_model(n_q, n_k, bq, bk, causal):
    r = recorded_io(n_q, n_k, 8, bq, bk, causal)
    assert (r["reads"], r["writes"]) == (r["formula_reads"], r["formula_writes"]), r
    assert (r["tiles"], r["skipped"]) == (r["formula_tiles"], r["formula_skipped"]), r


def test_causal_skip_saves_about_half_the_flops():
    t = causal_tiles(1024, 1024, 64, 64)
    assert t["skipped"] == 16 * 15 // 2 and t["computed"] == 16 * 17 // 2
    assert abs(t["fraction_saved"] - 15 / 32) < 1e-12
    log = TileLog()
    flash_attention_forward(torch.zeros(1024, 4), torch.zeros(1024, 4), torch.zeros(1024, 4), True, 64, 64, log)
    assert (log.tiles, log.skipped) == (t["computed"], t["skipped"])


def test_io_follows_theorem_2():
    d, m = 64, 64 * 1024  # an SRAM of 64 Ki elements: Algorithm 1's tiles B_r x B_c = 64 x 256
    assert block_size_for_sram(m, d) == (64, 256)
    ratios = []
    for n in (1024, 4096, 16384):
        tiled, naive = tiled_io_for_sram(n, d, m)["total"], naive_io(n, d)["total"]
        # Algorithm 1: K, V read once; Q_i, O_i, l_i, m_i read and O_i, l_i, m_i written per key block
        t_c = n // 256
        assert tiled == 2 * n * d + t_c * (2 * n * d + 2 * n) + t_c * (n * d + 2 * n), (n, tiled)
        ratios.append(tiled / theorem2_bound(n, d, m))
        assert tiled < naive / 4, (n, tiled, naive)  # -> naive / (M / 3d^2) = naive / 5.3 as N grows
    assert ratios[0] > ratios[1] > ratios[2] > 12, ratios  # the 12 N^2 d^2 / M term takes over
    # bigger SRAM, fewer accesses: Θ(1/M)
    assert tiled_io_for_sram(4096, d, 2 * m)["total"] < 0.6 * tiled_io_for_sram(4096, d, m)["total"]
    # minitrain's order with the same tiles: K, V read N / B_r times, B_r = d whatever M
    ours = tiled_io_for_sram(4096, d, m, order="fa2")["total"]
    assert ours == tiled_io_for_sram(4096, d, 4 * m, order="fa2")["total"] == tiled_io(4096, 4096, d, 64, 256)["total"]
    assert tiled_io(10, 10, 4, 4, 4)["writes"] == 10 * 4 + 10


def test_gpt_trains_to_the_same_losses_with_flash_attention():
    config = GPTConfig(seq_len=32, n_layer=2, n_head=4, d_model=32)
    losses = {}
    for name in ("naive", "flash"):
        torch.manual_seed(0)
        model = GPT(config)
        if name == "flash":
            set_attention_fn(model, flash_attention_fn)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses[name] = []
        for step in range(15):
            x, y = get_batch(step, 8, vocab_size=config.vocab_size, seq_len=config.seq_len)
            loss = model.loss(x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    assert losses["flash"][-1] < losses["flash"][0] - 0.3, losses["flash"]
    for a, b in zip(losses["naive"], losses["flash"]):
        assert abs(a - b) < 1e-4, (losses["naive"], losses["flash"])


def test_bad_inputs_are_named():
    q, k, v, _ = _qkv((1, 3, 8, 4), (1, 2, 8, 4))
    with pytest.raises(ValueError, match="Hkv dividing Hq"):
        flash_attention(q, k, v)
    with pytest.raises(ValueError, match="same D"):
        flash_attention(torch.zeros(4, 8), torch.zeros(4, 6), torch.zeros(4, 6))
    with pytest.raises(ValueError, match="dropout_p=0.1"):
        flash_attention_fn(q, q, q, dropout_p=0.1, training=True)


def test_composes_with_checkpointing():
    # full checkpointing recomputes each block's forward, flash attention included, in backward;
    # the gradients must equal the un-checkpointed naive model's
    from minitrain.checkpointing import set_checkpointing

    config = GPTConfig(seq_len=16, n_layer=2, n_head=2, d_model=16)
    x, y = get_batch(0, 4, vocab_size=config.vocab_size, seq_len=config.seq_len)
    grads = {}
    for name in ("naive", "flash+checkpoint"):
        torch.manual_seed(0)
        model = GPT(config)
        if name != "naive":
            set_attention_fn(model, flash_attention_fn)
            set_checkpointing(model, "full")
        model.loss(x, y).backward()
        grads[name] = {n: p.grad for n, p in model.named_parameters()}
    for n, g in grads["naive"].items():
        torch.testing.assert_close(grads["flash+checkpoint"][n], g, **FP32, msg=lambda m, n=n: f"{n}: {m}")
