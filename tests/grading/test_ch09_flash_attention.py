"""Graded tests of chapter 9: your online-softmax update, your tiled forward of one query
block and your backward of one tile, each against plain softmax attention written out (and
torch's scaled_dot_product_attention). fp32 tolerance 2e-5: sums in another order."""

import math

import pytest
import torch
import torch.nn.functional as F

from minitrain.flash_attention import tiles

TOL = dict(atol=2e-5, rtol=1e-5)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _softmax_attention(q, k, v, causal):  # the reference: scores, probabilities, output, lse
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def _says(what, got, want, hint=""):
    """assert_close's msg: what differs, by how much and where, in one line (the grader shows
    the first line only, and torch's own first line is "Tensor-likes are not close!")."""

    def message(torch_says):
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"{what}: {torch_says.splitlines()[0]}{hint}"
        bad = ~torch.isclose(got.float(), want.float(), **TOL)
        at = tuple(int(i) for i in bad.nonzero()[0]) if bad.any() else ()
        err = (got.float() - want.float()).abs().nan_to_num(math.inf).max().item()
        return (
            f"{what}: {int(bad.sum())} of {bad.numel()} values differ, the largest by {err:.3g}; "
            f"at index {at} yours is {got[at].item():.4g}, the reference "
            f"{want[at].item():.4g}{hint}"
        )

    return message


def _fold(tiles_of_s, v_tiles):
    """Your update applied tile after tile, starting from m = -inf, sum 0, acc 0."""
    rows = tiles_of_s[0].shape[:-1]
    m, row_sum = torch.full(rows, -math.inf), torch.zeros(rows)
    acc = torch.zeros(*rows, v_tiles[0].shape[-1])
    for s, v in zip(tiles_of_s, v_tiles):
        m, row_sum, acc = tiles.online_softmax_update(m, row_sum, acc, s, v)
    return m, row_sum, acc


@pytest.mark.exercise("online_softmax_update", points=1)
def test_one_tile_is_the_plain_softmax():
    s, v = _randn(5, 7, seed=1), _randn(7, 3, seed=2)
    m, row_sum, acc = _fold([s], [v])
    torch.testing.assert_close(m, s.amax(-1), **TOL,
                               msg=_says("online_softmax_update: m after one tile (should be "
                                         "the row max of s)", m, s.amax(-1)))
    want = torch.softmax(s, -1) @ v
    torch.testing.assert_close(acc / row_sum[:, None], want, **TOL,
                               msg=_says("online_softmax_update: acc / row_sum after one tile "
                                         "(should be softmax(s) @ v)", acc / row_sum[:, None], want))


@pytest.mark.exercise("online_softmax_update", points=2)
def test_a_larger_max_later_rescales_what_was_summed():
    # the second tile's scores are far larger: the sum and acc of the first tile must be
    # rescaled by exp(m_old - m_new), or the first tile counts far too much
    s1, s2 = _randn(4, 6, seed=3), _randn(4, 5, seed=4) + 6.0
    v1, v2 = _randn(6, 3, seed=5), _randn(5, 3, seed=6)
    m, row_sum, acc = _fold([s1, s2], [v1, v2])
    s, v = torch.cat([s1, s2], -1), torch.cat([v1, v2], 0)
    hint = " (rescale the old row_sum and acc by exp(m_old - m_new))"
    lse, want_lse = m + torch.log(row_sum), torch.logsumexp(s, -1)
    torch.testing.assert_close(lse, want_lse, **TOL,
                               msg=_says("online_softmax_update over two tiles: m + log(row_sum) "
                                         "(should be the logsumexp of both)", lse, want_lse, hint))
    out, want = acc / row_sum[:, None], torch.softmax(s, -1) @ v
    torch.testing.assert_close(out, want, **TOL,
                               msg=_says("online_softmax_update over two tiles: acc / row_sum "
                                         "(should be softmax(both tiles) @ v)", out, want, hint))


@pytest.mark.exercise("online_softmax_update", points=1)
def test_masked_entries_count_for_nothing():
    s, v = _randn(3, 4, seed=7), _randn(4, 2, seed=8)
    s_masked = s.clone()
    s_masked[:, 2:] = -math.inf
    m, row_sum, acc = _fold([s_masked], [v])
    out, want = acc / row_sum[:, None], torch.softmax(s[:, :2], -1) @ v[:2]
    torch.testing.assert_close(out, want, **TOL,
                               msg=_says("online_softmax_update with -inf (masked) scores: "
                                         "acc / row_sum", out, want))


@pytest.mark.exercise("online_softmax_update", points=1)
def test_bf16_values_accumulate_in_fp32():
    # notebook 09 runs flash attention on bf16 inputs: the running state and the scores are
    # fp32 (the accumulation dtype), v stays bf16 — the tile's probabilities meet v in v's dtype
    s, v = _randn(4, 6, seed=15), _randn(6, 3, seed=16).to(torch.bfloat16)
    try:
        m, row_sum, acc = _fold([s], [v])
    except NotImplementedError:
        raise
    except RuntimeError as exc:
        raise AssertionError(
            f"online_softmax_update with fp32 scores and bf16 v (4x6 scores, 6x3 values, as "
            f"notebook 09's bf16 check runs it) raised RuntimeError: {str(exc).splitlines()[0]} "
            f"— a matmul needs both sides in one dtype: cast them to acc's dtype for the "
            f"product (tile_matmul does)") from None
    assert (m.dtype, row_sum.dtype, acc.dtype) == (torch.float32,) * 3, (
        f"online_softmax_update with bf16 v: m, row_sum, acc must stay in the accumulation "
        f"dtype float32 (summing in bf16 loses digits every tile); got {m.dtype}, "
        f"{row_sum.dtype}, {acc.dtype}")
    want = torch.softmax(s, -1) @ v.float()
    got = acc / row_sum[:, None]
    assert (got - want).abs().max().item() < 2e-2, (
        f"online_softmax_update with bf16 v: acc / row_sum differs from softmax(s) @ v by "
        f"{(got - want).abs().max().item():.3g} (bf16 allows about 1e-2)")


@pytest.mark.exercise("online_softmax_update", points=1)
def test_the_product_with_bf16_v_is_accumulated_in_fp32():
    # scores k * ln 2: the probabilities are powers of two, exact in bf16, so the only error
    # left is the product's. A tensor core sums bf16 products in fp32 (exact here); a bf16
    # matmul rounds P v to 8 bits (2^-9 relative) before it reaches the fp32 accumulator
    s = -math.log(2.0) * ((torch.arange(6) + torch.arange(4)[:, None]) % 6).float()
    v = _randn(6, 3, seed=23).to(torch.bfloat16)
    m, row_sum, acc = _fold([s], [v])
    got, want = (acc / row_sum[:, None]).double(), torch.softmax(s.double(), -1) @ v.double()
    err = (got - want).abs().max().item()
    assert err < 1e-5, (
        f"online_softmax_update with bf16 v: acc / row_sum differs from fp64 softmax(s) @ v by "
        f"{err:.3g}, with probabilities exact in bf16 (fp32 accumulation gives < 1e-6): the "
        f"product p @ v was rounded to bf16 — accumulate it in acc's dtype (tile_matmul)")


@pytest.mark.exercise("forward_query_block", points=2)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_of_a_query_block_matches_softmax_attention(causal):
    q, k, v = _randn(2, 21, 8, seed=9), _randn(2, 21, 8, seed=10), _randn(2, 21, 8, seed=11)
    out_ref, lse_ref = _softmax_attention(q, k, v, causal)
    for i0, i1 in [(0, 7), (7, 14), (14, 21)]:  # key blocks of 5: several tiles, a short last one
        out, lse = tiles.forward_query_block(q[:, i0:i1], k, v, i0, causal, 5)
        torch.testing.assert_close(out, out_ref[:, i0:i1], **TOL,
                                   msg=_says(f"forward_query_block: the output of rows {i0}-{i1 - 1}",
                                             out, out_ref[:, i0:i1]))
        torch.testing.assert_close(lse, lse_ref[:, i0:i1], **TOL,
                                   msg=_says(f"forward_query_block: the logsumexp of rows "
                                             f"{i0}-{i1 - 1}", lse, lse_ref[:, i0:i1]))


def _bf16_tile(seed):
    """bf16 q, k of scale 4 (scores of ~±16: a bf16 score is off by up to 2^-9 * 16 = 0.03,
    so each probability by ~3 %), v and dO of scale 1."""
    q, k = (_randn(2, 12, 16, seed=seed + i).mul(4).to(torch.bfloat16) for i in (0, 1))
    v, do = (_randn(2, 12, 16, seed=seed + i).to(torch.bfloat16) for i in (2, 3))
    return q, k, v, do


def _why(err_fp32, dtype_advice):
    """What to fix: the dtype if the same values in fp32 come out right, else not the dtype."""
    if err_fp32 < 1e-4:
        return dtype_advice
    return (f"and by {err_fp32:.3g} with the same values in fp32, so the bug is not the dtype "
            f"(see the fp32 tests' messages)")


@pytest.mark.exercise("forward_query_block", points=1)
def test_bf16_scores_accumulate_in_fp32():
    q, k, v, _ = _bf16_tile(30)
    out_ref, lse_ref = _softmax_attention(q.double(), k.double(), v.double(), False)
    out, lse = tiles.forward_query_block(q, k, v, 0, False, 5)
    assert (out.dtype, lse.dtype) == (torch.float32,) * 2, (
        f"forward_query_block with bf16 inputs: out and lse must be in the accumulation dtype "
        f"float32; got {out.dtype}, {lse.dtype}")
    out32, lse32 = tiles.forward_query_block(q.float(), k.float(), v.float(), 0, False, 5)
    errs = [(t.double() - r).abs().max().item() for t, r in ((lse, lse_ref), (lse32, lse_ref))]
    assert errs[0] < 1e-4, (
        f"forward_query_block with bf16 q, k, v: the logsumexp differs from fp64's by "
        f"{errs[0]:.3g} (fp32 scores give ~1e-6), " + _why(errs[1], (
            "the scores were rounded to bf16 — compute q_i k_j^T with tile_matmul(..., "
            "acc_dtype), exact products of bf16 values summed in fp32")))
    err = ((out.double() - out_ref).norm() / out_ref.norm()).item()
    assert err < 3e-3, (f"forward_query_block with bf16 q, k, v: the output is off by {err:.3g} "
                        f"(relative, vs fp64; fp32 scores and products give < 1e-3)")


@pytest.mark.exercise("block_backward", points=1)
def test_bf16_tile_gradients_accumulate_in_fp32():
    q, k, v, do = _bf16_tile(40)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    out, lse = _softmax_attention(q64, k64, v64, False)
    want = torch.autograd.grad(out, (q64, k64, v64), do.double())
    delta = (do.double() * out.detach()).sum(-1)
    stats = lse.detach().float(), delta.float()
    got = tiles.block_backward(q, k, v, do, *stats)
    got32 = tiles.block_backward(*(t.float() for t in (q, k, v, do)), *stats)
    for name, a, a32, b in zip(("dq", "dk", "dv"), got, got32, want):
        assert a.dtype == torch.float32, f"block_backward with bf16 inputs: {name} is {a.dtype}, not float32"
        err, err32 = (((t.double() - b).norm() / b.norm()).item() for t in (a, a32))
        assert err < 6e-3, (
            f"block_backward with bf16 q, k, v, dO: {name} is off by {err:.3g} (relative, vs "
            f"fp64; fp32 scores give ~2e-3), " + _why(err32, (
                "the scores or products were rounded to bf16 — every product through "
                "tile_matmul(..., acc_dtype)")))


@pytest.mark.exercise("forward_query_block", points=1)
def test_causal_forward_visits_no_fully_masked_tile():
    log = tiles.TileLog()
    q, k, v = _randn(1, 8, 4, seed=12), _randn(1, 32, 4, seed=13), _randn(1, 32, 4, seed=14)
    tiles.forward_query_block(q, k, v, 0, True, 8, log)
    assert (log.tiles, log.skipped) == (1, 3), (
        f"rows 0-7 causal with key blocks of 8 need 1 tile and skip 3; your loop visited "
        f"{log.tiles} and skipped {log.skipped} (use visible_key_blocks)")


@pytest.mark.exercise("block_backward", points=2)
def test_backward_of_one_whole_tile_matches_autograd():
    q, k, v = (_randn(2, 6, 4, seed=s).requires_grad_() for s in (15, 16, 17))
    do = _randn(2, 6, 4, seed=18)
    out = F.scaled_dot_product_attention(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    lse = _softmax_attention(q, k, v, False)[1].detach()
    delta = (do * out.detach()).sum(-1)
    ours = tiles.block_backward(q.detach(), k.detach(), v.detach(), do, lse, delta)
    for name, a, b in zip(("dq", "dk", "dv"), ours, (dq, dk, dv)):
        torch.testing.assert_close(a, b, **TOL, msg=_says(f"block_backward: {name} of one whole tile", a, b))


@pytest.mark.exercise("block_backward", points=2)
def test_backward_tiles_add_up_with_a_causal_mask():
    q, k, v = (_randn(1, 8, 4, seed=s).requires_grad_() for s in (19, 20, 21))
    do = _randn(1, 8, 4, seed=22)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    lse = _softmax_attention(q, k, v, True)[1].detach()
    delta = (do * out.detach()).sum(-1)
    got_dq, got_dk, got_dv = torch.zeros_like(dq), torch.zeros_like(dk), torch.zeros_like(dv)
    for i0 in (0, 4):
        for j0 in (0, 4):
            if j0 > i0 + 3:
                continue  # fully masked tile
            mask = tiles.causal_mask(i0, i0 + 4, j0, j0 + 4)
            a, b, c = tiles.block_backward(q.detach()[:, i0:i0 + 4], k.detach()[:, j0:j0 + 4],
                                           v.detach()[:, j0:j0 + 4], do[:, i0:i0 + 4],
                                           lse[:, i0:i0 + 4], delta[:, i0:i0 + 4], mask)
            got_dq[:, i0:i0 + 4] += a
            got_dk[:, j0:j0 + 4] += b
            got_dv[:, j0:j0 + 4] += c
    for name, a, b in zip(("dq", "dk", "dv"), (got_dq, got_dk, got_dv), (dq, dk, dv)):
        torch.testing.assert_close(a, b, **TOL,
                                   msg=_says(f"block_backward: {name} summed over the causal tiles", a, b))
