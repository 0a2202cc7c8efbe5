"""Graded tests of chapter 3: your checkpoint against plain autograd, your segment choice
against a brute-force search over the peak-memory formula."""

import math

import pytest
import torch
from torch import nn

from minitrain import checkpointing
from minitrain.memory import saved_activation_bytes


class TwoInOut(nn.Module):
    """Two tensor inputs, a number, dropout, two outputs."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x, y, scale):
        h = torch.tanh(self.a(x)) * scale + self.b(y)
        keep = torch.rand_like(h) >= 0.5  # dropout: backward must see the same mask
        h = h * keep * 2.0
        return h.relu(), (h * y).sum(-1)


def _inputs(y_requires_grad=True):
    torch.manual_seed(0)
    module = TwoInOut()
    x = torch.randn(3, 6, requires_grad=True)
    y = torch.randn(3, 6, requires_grad=y_requires_grad)
    return module, x, y


def _apply(fn, *args):
    return checkpointing.CheckpointFunction.apply(fn, True, *args)


@pytest.mark.exercise("CheckpointFunction.forward", points=2)
def test_forward_returns_fn_output_and_keeps_only_inputs():
    module, x, y = _inputs()
    torch.manual_seed(1)
    want = module(x, y, 2.0)
    torch.manual_seed(1)
    got = _apply(module, x, y, 2.0)
    assert isinstance(got, tuple) and len(got) == 2, "CheckpointFunction.forward must return fn's two outputs"
    for g, w in zip(got, want):
        assert torch.equal(g, w), (
            "CheckpointFunction.forward's output differs from calling fn directly")
    assert got[0].requires_grad, (
        "CheckpointFunction.forward: the output of CheckpointFunction.apply must require grad")
    saved = saved_activation_bytes(lambda: _apply(module, x, y, 2.0), exclude=[module])
    assert saved == x.nbytes + y.nbytes, (
        f"CheckpointFunction.forward saved {saved} bytes for backward; it should keep only its two tensor "
        f"inputs, {x.nbytes + y.nbytes} bytes (is fn running with grad enabled?)"
    )


def _loss_and_grads(use_checkpoint, y_requires_grad):
    module, x, y = _inputs(y_requires_grad)
    torch.manual_seed(42)
    out, s = _apply(module, x, y, 3.0) if use_checkpoint else module(x, y, 3.0)
    torch.rand(3)  # the caller's stream moves on between forward and backward
    try:
        (out.square().sum() + s.sum()).backward()
    except RuntimeError as exc:
        if "incorrect number of gradients" not in str(exc):
            raise
        # autograd's own words name neither the rule nor forward's arguments: say both
        raise AssertionError(
            f"CheckpointFunction.backward must return one gradient per argument of forward "
            f"(fn, preserve_rng_state, then each of *args: None for fn and preserve_rng_state "
            f"and for every non-tensor); autograd says: {exc}"
        ) from None
    after = torch.rand(4)
    grads = {"x": x.grad, "y": y.grad}
    grads.update({n: p.grad for n, p in module.named_parameters()})
    return grads, after


@pytest.mark.exercise("CheckpointFunction.backward", points=2)
@pytest.mark.parametrize("y_requires_grad", [True, False])
def test_backward_gives_the_gradients_of_plain_autograd(y_requires_grad):
    want, _ = _loss_and_grads(False, y_requires_grad)
    got, _ = _loss_and_grads(True, y_requires_grad)
    for name, w in want.items():
        if w is None:
            assert got[name] is None, f"CheckpointFunction.backward: {name} does not require grad, yet got a gradient"
            continue
        assert got[name] is not None, (
            f"CheckpointFunction.backward: no gradient reached {name} (re-run fn on leaves "
            f"that require grad where needs_input_grad says so)")
        assert torch.allclose(got[name], w, atol=1e-6), (
            f"CheckpointFunction.backward: gradient of {name} differs from the "
            f"un-checkpointed run by "
            f"{(got[name] - w).abs().max().item():.3g}: is the dropout mask the same in "
            "the recomputation (RNG state restored)?"
        )


@pytest.mark.exercise("CheckpointFunction.forward", points=1)
def test_forward_keeps_the_rng_state_for_the_recomputation():
    # graded with the reference backward: it replays from the state forward saved
    want, _ = _loss_and_grads(False, True)
    got, _ = _loss_and_grads(True, True)
    diff = (got["x"] - want["x"]).abs().max().item() if got["x"] is not None else float("nan")
    assert diff <= 1e-6, (
        f"CheckpointFunction.forward: with dropout inside fn and random draws between forward "
        f"and backward, the gradient of x differs from the un-checkpointed run by {diff:.3g}: "
        f"the recomputation drew another dropout mask — save the RNG state (get_rng_state) "
        f"before fn runs when preserve_rng_state is True"
    )


@pytest.mark.exercise("CheckpointFunction.backward", points=2)
def test_backward_leaves_the_random_stream_as_it_found_it():
    _, want = _loss_and_grads(False, True)
    _, got = _loss_and_grads(True, True)
    assert torch.equal(got, want), (
        "CheckpointFunction.backward: with random draws between forward and backward, "
        "torch.rand after backward gives different numbers than without checkpointing: "
        "put the caller's RNG state back after recomputing (in finally)"
    )


@pytest.mark.exercise("CheckpointFunction.backward", points=1)
def test_backward_restores_the_random_stream_when_the_recomputation_raises():
    calls = []

    def fn(x):  # draws random numbers; the second time, in backward's recomputation, it fails
        calls.append(1)  # before drawing: the generator is left at the forward's state
        if len(calls) == 2:
            raise ValueError("recomputation failed")
        return x * torch.rand_like(x)

    x = torch.randn(3, requires_grad=True)
    torch.manual_seed(5)
    out = _apply(fn, x)
    before = torch.get_rng_state()
    raised = None
    try:
        out.sum().backward()
    except Exception as exc:  # noqa: BLE001 — whatever autograd wraps it in
        raised = exc
    assert raised is not None and "recomputation failed" in str(raised), (
        f"CheckpointFunction.backward: fn raised during the recomputation, but backward "
        f"{'returned' if raised is None else f'raised {type(raised).__name__}: {raised}'}")
    assert torch.equal(torch.get_rng_state(), before), (
        "CheckpointFunction.backward: fn raised during the recomputation and the caller's "
        "random stream was left at the forward's state — put the current state back in a "
        "finally, so it is restored whatever fn does")


def _outcome(fn, *args, **kwargs):
    """(the exception fn raised or None, what it returned): to say both in plain words."""
    try:
        return None, fn(*args, **kwargs)
    except Exception as exc:
        return exc, None


def _brute_force(L, A, c, budget=None):
    peaks = [(k - 1) * c + math.ceil(L / k) * A for k in range(1, L + 1)]
    if budget is None:
        return 1 + peaks.index(min(peaks))
    return next((k for k, p in enumerate(peaks, start=1) if p <= budget), None)


@pytest.mark.exercise("choose_segments", points=1)
@pytest.mark.parametrize("L,A,c", [(64, 10, 10), (100, 4, 4), (16, 20, 1), (30, 3, 7), (1, 5, 5)])
def test_choose_segments_minimises_the_peak(L, A, c):
    got = checkpointing.choose_segments(L, A, c)
    want = _brute_force(L, A, c)
    assert got == want, f"choose_segments({L}, {A}, {c}) returned {got}, the best is {want}"


@pytest.mark.exercise("choose_segments", points=2)
def test_choose_segments_with_a_budget():
    for budget in (640, 330, 329, 200, 160, 150):
        got = checkpointing.choose_segments(64, 10, 10, budget_bytes=budget)
        want = _brute_force(64, 10, 10, budget)
        assert got == want, (
            f"choose_segments(64, 10, 10, budget_bytes={budget}) returned {got}; the fewest "
            f"segments whose peak fits the budget are {want}"
        )
    # nothing fits: every peak is at least 150 bytes (k = 8)
    error, returned = _outcome(checkpointing.choose_segments, 64, 10, 10, budget_bytes=100)
    assert isinstance(error, ValueError), (
        "choose_segments(64, 10, 10, budget_bytes=100): no segment count fits (the smallest "
        "peak is 150 bytes), so a ValueError naming the budget was expected; your function "
        + (f"returned {returned!r}" if error is None else f"raised {type(error).__name__}: {error}")
    )
    assert "100" in str(error), (
        f"the ValueError should name the budget, 100; its message was: {error}"
    )


@pytest.mark.exercise("choose_segments", points=1)
@pytest.mark.parametrize("L,A,c", [(6, 1, 1), (3, 2, 2), (6, 3, 1), (7, 1, 1), (4, 2, 1)])
def test_choose_segments_breaks_ties_with_fewer_segments(L, A, c):
    peaks = [(k - 1) * c + math.ceil(L / k) * A for k in range(1, L + 1)]
    tied = [k for k, p in enumerate(peaks, start=1) if p == min(peaks)]
    got = checkpointing.choose_segments(L, A, c)
    assert got == tied[0], (
        f"choose_segments({L}, {A}, {c}) returned {got}; segment counts {tied} all give the "
        f"smallest peak, {min(peaks)} bytes, and the fewest segments ({tied[0]}) recompute least"
    )
