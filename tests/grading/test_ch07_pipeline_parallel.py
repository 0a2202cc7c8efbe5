"""Graded tests of chapter 7: your 1F1B generator against the paper's order and its closed
forms, your executor step against one process's autograd, your bubble fraction against the
formulas (Huang et al. 2019; Narayanan et al. 2021, section 2.2; Qi et al. 2024)."""

import copy
from fractions import Fraction

import pytest
import torch

from minitrain.runtime import launch

F, B, W = "F", "B", "W"


# ---------------------------------------------------------------------- 1F1B generator
@pytest.mark.exercise("one_f_one_b_schedule", points=3)
def test_one_f_one_b_order_bubble_and_memory():
    from minitrain.pipeline import one_f_one_b_schedule, simulate
    from minitrain.pipeline.check import ScheduleError, validate

    for p, m in [(1, 1), (2, 1), (4, 2), (4, 3), (3, 4)]:  # m < p included: warm-up is capped at m
        got = one_f_one_b_schedule(p, m)
        assert isinstance(got, list) and len(got) == p, (
            f"one_f_one_b_schedule({p}, {m}) must return one list of actions per stage ({p}); "
            f"got {type(got).__name__} of length {len(got) if hasattr(got, '__len__') else '?'}")
        try:
            validate(got, m)
        except ScheduleError as exc:
            raise AssertionError(
                f"one_f_one_b_schedule({p}, {m}) is malformed: {exc} — each stage runs F then "
                f"B of every micro-batch 0..{m - 1} exactly once; with m < p the warm-up "
                f"is min(p - s - 1, m) forwards") from None

    got = one_f_one_b_schedule(3, 4)
    want = [[(F, 0), (F, 1), (F, 2), (B, 0), (F, 3), (B, 1), (B, 2), (B, 3)],
            [(F, 0), (F, 1), (B, 0), (F, 2), (B, 1), (F, 3), (B, 2), (B, 3)],
            [(F, 0), (B, 0), (F, 1), (B, 1), (F, 2), (B, 2), (F, 3), (B, 3)]]
    bad = next((s for s in range(3) if s >= len(got) or got[s] != want[s]), 0)
    assert got == want, (
        f"one_f_one_b_schedule(3, 4) for stage {bad} should be {want[bad]}, got "
        f"{got[bad] if bad < len(got) else 'no list for that stage'} (stage s runs p - s - 1 "
        f"warm-up forwards, then alternates F and B)")
    sim = simulate(one_f_one_b_schedule(4, 8))
    assert (sim.makespan, sim.peak_in_flight) == (22, [4, 3, 2, 1]), (
        f"1F1B at p=4, m=8 with unit costs should take 22 units holding [4, 3, 2, 1] micro-batches "
        f"per stage; yours takes {sim.makespan} holding {sim.peak_in_flight}")
    for p in range(1, 6):
        for m in range(1, 9):
            sim = simulate(one_f_one_b_schedule(p, m))  # raises if malformed or deadlocking
            assert sim.bubble_fraction == Fraction(p - 1, m + p - 1), (
                f"p={p}, m={m}: bubble {sim.bubble_fraction}, expected (p-1)/(m+p-1) = "
                f"{Fraction(p - 1, m + p - 1)}")
            assert sim.peak_in_flight == [min(p - s, m) for s in range(p)], (
                f"p={p}, m={m}: stage s should hold at most min(p - s, m) micro-batches, yours "
                f"holds {sim.peak_in_flight} (check the warm-up count)")


# ---------------------------------------------------------------------- executor step
ZB_2_2 = [[(F, 0), (F, 1), (B, 0), (W, 0), (B, 1), (W, 1)],
          [(F, 0), (B, 0), (F, 1), (B, 1), (W, 0), (W, 1)]]
ONE_F_ONE_B_3_3 = [[(F, 0), (F, 1), (F, 2), (B, 0), (B, 1), (B, 2)],
                   [(F, 0), (F, 1), (B, 0), (F, 2), (B, 1), (B, 2)],
                   [(F, 0), (B, 0), (F, 1), (B, 1), (F, 2), (B, 2)]]
INTERLEAVED_2_2_2 = [[(F, 0, 0), (F, 1, 0), (F, 0, 1), (F, 1, 1), (B, 0, 1), (B, 1, 1), (B, 0, 0), (B, 1, 0)],
                     [(F, 0, 0), (F, 1, 0), (F, 0, 1), (B, 0, 1), (F, 1, 1), (B, 1, 1), (B, 0, 0), (B, 1, 0)]]


def _step(cases):
    from minitrain.model import GPT, GPTConfig
    from minitrain.pipeline import PipelineStage

    out = []
    for name, schedule, m, v, *policy in cases:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=16, seq_len=8, n_layer=4, n_head=2, d_model=8))
        ref = copy.deepcopy(model)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randint(0, 16, (6, 8), generator=g), torch.randint(0, 16, (6, 8), generator=g)
        ref_loss = ref.loss(x, y)
        ref_loss.backward()
        stage = PipelineStage(model, num_chunks=v, checkpointing=policy[0] if policy else None)
        try:
            loss = stage.train_step(x, y, schedule, m)
        except (AttributeError, TypeError, KeyError) as exc:  # bare, deep in the executor
            # (not RuntimeError: its peers' "connection closed" must not look like this rank's)
            hint = (" — x.grad is None: does the received activation require grad "
                    "(.requires_grad_()) so backward fills its gradient?"
                    if "NoneType" in str(exc) else
                    " — W found no parked gradient: with checkpointing B did the whole backward "
                    "(state.split_backward is False), so W must do nothing"
                    if isinstance(exc, KeyError) and "W" in str(schedule) else "")
            raise AssertionError(f"{name}: your run_action raised {type(exc).__name__}: "
                                 f"{exc}{hint}") from exc
        refp = dict(ref.named_parameters())
        worst = max(((q.grad - refp[n].grad).abs().max().item() if q.grad is not None else float("inf"), n)
                    for n, q in stage.model.named_parameters())
        out.append((name, abs(loss.item() - ref_loss.item()), worst))
    return out


@pytest.mark.exercise("run_action", points=4)
def test_run_action_trains_like_one_process():
    from minitrain.pipeline import gpipe_schedule

    runs = {2: [("GPipe p=2 m=3", gpipe_schedule(2, 3), 3, 1), ("zero bubble p=2 m=2", ZB_2_2, 2, 1),
                ("interleaved p=2 m=2 v=2", INTERLEAVED_2_2_2, 2, 2),
                # notebook 07 runs zero bubble with checkpointing: B then does the whole backward
                ("zero bubble p=2 m=2 with checkpointing='full'", ZB_2_2, 2, 1, "full")],
            3: [("1F1B p=3 m=3", ONE_F_ONE_B_3_3, 3, 1), ("GPipe p=3 m=1", gpipe_schedule(3, 1), 1, 1)]}
    for p, cases in runs.items():
        for rank, rows in enumerate(launch(_step, p, cases, timeout=90)):
            for name, dloss, (dgrad, param) in rows:
                assert dloss < 1e-6, (
                    f"run_action, {name}, rank {rank}: the loss differs from one process by {dloss}")
                assert dgrad < 1e-6, (
                    f"run_action, {name}, rank {rank}: the gradient of {param} differs from one "
                    f"process by {dgrad} (inf: it was never computed — a schedule without W "
                    f"actions needs B to compute the weight gradients too: split the backward "
                    f"only when state.split_backward)")


# ---------------------------------------------------------------------- bubble fraction
@pytest.mark.exercise("bubble_fraction", points=3)
def test_bubble_fraction_against_the_formulas(monkeypatch):
    from minitrain.pipeline import check, gpipe_schedule

    def no_simulate(*args, **kwargs):
        raise AssertionError("bubble_fraction must run the schedule itself, not call simulate")

    monkeypatch.setattr(check, "simulate", no_simulate)
    for p in range(1, 5):
        for m in range(1, 7):
            got = check.bubble_fraction(gpipe_schedule(p, m))
            assert got == Fraction(p - 1, m + p - 1), (
                f"bubble_fraction of GPipe p={p}, m={m}: got {got}, expected (p-1)/(m+p-1) = "
                f"{Fraction(p - 1, m + p - 1)} (the idle share: 1 - busy / (p * makespan))")
    got = check.bubble_fraction(ONE_F_ONE_B_3_3)
    assert got == Fraction(2, 5), f"bubble_fraction of 1F1B p=3, m=3: got {got}, expected 2/5"
    got = check.bubble_fraction(INTERLEAVED_2_2_2, num_chunks=2)
    assert got == Fraction(1, 5), f"bubble_fraction of interleaved p=2, m=2, v=2 (chunks cost 1/2): got {got}, expected (p-1)/(vm+p-1) = 1/5"
    got = check.bubble_fraction(ZB_2_2)  # F = B = W = 1: makespan 3m + (p-1) = 7, busy 12
    assert got == Fraction(1, 7), f"bubble_fraction of zero bubble p=2, m=2: got {got}, expected 1 - 12/(2*7) = 1/7"
    # stage 1 idles 1 unit at the start; stage 0 idles while micro-batch 0 goes forward and back
    got = check.bubble_fraction([[(F, 0), (B, 0)], [(F, 0), (B, 0)]])
    assert got == Fraction(1, 2), f"bubble_fraction of p=2, m=1 (F, B per stage): got {got}, expected 1/2"
    with pytest.raises(ValueError, match="deadlock"):
        check.bubble_fraction([[(F, 0), (B, 0), (F, 1), (B, 1)], [(F, 0), (F, 1), (B, 1), (B, 0)]])
