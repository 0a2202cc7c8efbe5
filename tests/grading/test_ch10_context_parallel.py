"""Graded tests of chapter 10: your merge of two partial attention results by their
logsumexp, and your forward ring step, each against attention computed in plain torch on
the whole sequence (softmax and logsumexp, or torch's scaled_dot_product_attention).
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minitrain.runtime import launch

ATOL = 2e-5  # fp32 softmax summed in pieces: a few rounding steps on values of order 1


def _partial(q, k, v):
    """Attention of q over k, v and its logsumexp, in plain torch (the reference)."""
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def _inputs(scale, n=5):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, n, 8, generator=g) * scale
    k, v = torch.randn(2, 3, 12, 8, generator=g), torch.randn(2, 3, 12, 8, generator=g)
    return q, k, v


@pytest.mark.exercise("merge_attention", points=2)
@pytest.mark.parametrize("scale,n", [(1.0, 5), (300.0, 5), (1.0, 8)],
                         ids=["ordinary scores", "scores near 1000", "as many queries as features"])
def test_merge_equals_attention_over_the_union(scale, n):
    from minitrain.context_parallel.merge import merge_attention

    q, k, v = _inputs(scale, n)
    case = f"{n} queries of {q.shape[-1]} features, scores scaled by {scale:g}"
    try:
        merge_attention(*_partial(q, k[..., :7, :], v[..., :7, :]), *_partial(q, k[..., 7:, :], v[..., 7:, :]))
    except NotImplementedError:
        raise
    except RuntimeError as exc:
        raise AssertionError(
            f"merge_attention ({case}) raised RuntimeError: {str(exc).splitlines()[0]} — the "
            f"weights have one value per query, shape (..., n): give them a last dimension of "
            f"1 before multiplying the (..., n, d) outputs") from None
    want_out, want_lse = _partial(q, k, v)
    a, b = _partial(q, k[..., :7, :], v[..., :7, :]), _partial(q, k[..., 7:, :], v[..., 7:, :])
    out, lse = merge_attention(a[0], a[1], b[0], b[1])
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), (
        f"merge_attention gave inf or nan with logsumexps up to {float(want_lse.max()):.0f}: "
        "exp of that overflows float32 — subtract the larger logsumexp before exponentiating")
    err_out, err_lse = (out - want_out).abs().max().item(), (lse - want_lse).abs().max().item()
    at = tuple(int(i) for i in torch.nonzero((out - want_out).abs() == err_out)[0])
    assert err_out <= ATOL * scale, (
        f"merge_attention ({case}): the merged output differs from attention over all keys by "
        f"{err_out:.3g}; at index {at} yours is {out[at].item():.4g}, the reference "
        f"{want_out[at].item():.4g}" + (" — with n == d the (..., n) weights broadcast "
        "against the features instead of the queries: give them a last dimension of 1"
        if n == q.shape[-1] else ""))
    at = tuple(int(i) for i in torch.nonzero((lse - want_lse).abs() == err_lse)[0])
    assert err_lse <= ATOL * scale, (
        f"merge_attention ({case}): the merged logsumexp differs from the full one by {err_lse:.3g}; "
        f"at index {at} yours is {lse[at].item():.4g}, log(exp(lse_a) + exp(lse_b)) is "
        f"{want_lse[at].item():.4g}")
    swapped, _ = merge_attention(b[0], b[1], a[0], a[1])
    assert (swapped - want_out).abs().max().item() <= ATOL * scale, "merging B then A must give the same"


@pytest.mark.exercise("merge_attention", points=1)
def test_merge_with_an_empty_side():
    from minitrain.context_parallel.merge import merge_attention

    q, k, v = _inputs(1.0)
    out_b, lse_b = _partial(q, k, v)
    empty_out, empty_lse = torch.zeros_like(out_b), torch.full_like(lse_b, -math.inf)
    out, lse = merge_attention(empty_out, empty_lse, out_b, lse_b)
    err = (out - out_b).abs().max().item()
    assert err <= ATOL and (lse - lse_b).abs().max().item() <= ATOL, (
        f"merging with an empty key set (lse = -inf) must return the other side; output off by {err:.3g}")
    out, lse = merge_attention(empty_out, empty_lse, empty_out, empty_lse)
    assert torch.equal(out, empty_out), f"two empty sides must give output 0, got {out.flatten()[:3].tolist()}"
    assert torch.isneginf(lse).all(), f"two empty sides must give lse -inf, got {lse.flatten()[:3].tolist()}"


def _ring_case(layout, causal):
    from minitrain.context_parallel import ring, shard_sequence

    events, sent = [], []
    real_batch, real_forward = dist.batch_isend_irecv, ring.flash_attention_forward
    real_step, real_wait = ring.ring_step, ring.Exchange.wait

    def step(*args, **kwargs):  # marks where each of ring_forward's calls begins
        events.append("step")
        return real_step(*args, **kwargs)

    def wait(self):
        events.append("wait")
        return real_wait(self)

    def batch(ops):  # Exchange pairs its send and receive in one group: count the sends
        sends = [op.tensor for op in ops if op.op is dist.isend]  # (a P2POp takes no wrapper)
        if sends:
            events.append("send")
            sent.extend(t.numel() * t.element_size() for t in sends)
        return real_batch(ops)

    def forward(*args, **kwargs):
        events.append("compute")
        return real_forward(*args, **kwargs)

    g = torch.Generator().manual_seed(11)
    q, k, v, do = (torch.randn(2, 2, 24, 8, generator=g) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=causal)
    ref.backward(do)
    shards = [shard_sequence(t, layout=layout).requires_grad_() for t in (q, k, v)]
    dist.batch_isend_irecv, ring.flash_attention_forward = batch, forward
    ring.ring_step, ring.Exchange.wait = step, wait
    try:
        y = ring.ring_attention(*shards, causal=causal, layout=layout)
    finally:
        dist.batch_isend_irecv, ring.flash_attention_forward = real_batch, real_forward
        ring.ring_step, ring.Exchange.wait = real_step, real_wait
    y.backward(shard_sequence(do, layout=layout))
    errors = [(y.detach() - shard_sequence(ref.detach(), layout=layout)).abs().max().item()]
    errors += [(s.grad - shard_sequence(f.grad, layout=layout)).abs().max().item()
               for s, f in zip(shards, full)]
    return errors, events, sum(sent), 2 * shards[0].numel() * 4


@pytest.mark.exercise("ring_step", points=3)
@pytest.mark.parametrize("layout,causal", [("contiguous", False), ("contiguous", True),
                                           ("zigzag", True)])
def test_ring_attention_with_your_step_equals_full_attention(layout, causal):
    world = 3
    for rank, (errors, events, sent, kv_bytes) in enumerate(
            launch(_ring_case, world, layout, causal, timeout=90)):
        where = f"rank {rank} ({layout}, causal={causal}, 3 ranks)"
        names = ("output", "dq", "dk", "dv")
        bad = {n: round(e, 6) for n, e in zip(names, errors) if not e <= ATOL}
        assert not bad, (
            f"{where}: ring attention with your ring_step differs from attention on the whole "
            f"sequence, largest differences {bad} (is each block's result merged into outs/lses "
            f"with merge_attention?)")
        assert sent == (world - 1) * kv_bytes, (
            f"{where}: the forward sent {sent} bytes; K and V go once round the ring: "
            f"{world - 1} sends of {kv_bytes} bytes (the last step sends nothing)"
            + (" — send with Exchange, which pairs the send with its receive in one "
               "batch_isend_irecv group (a lone isend deadlocks on NCCL)" if not sent else ""))
        first_compute = events.index("compute")
        assert "send" in events[:first_compute], (
            f"{where}: start sending the K/V block before computing on it, so the transfer "
            f"overlaps the compute (order seen: {events[:6]})")
        steps = "/".join(events).split("step")
        for n, one in enumerate(s.strip("/").split("/") for s in steps[1:]):
            if "wait" in one and "compute" in one[one.index("wait"):]:
                raise AssertionError(
                    f"{where}: in ring_forward's step {n} your ring_step waited for the next "
                    f"K/V block before computing on the one in hand (order: {one}); wait only "
                    f"after the compute, so the transfer overlaps it — waiting first leaves "
                    f"the rank idle for the whole transfer")
