"""Issue 28: python -m minitrain.train's learning-rate schedule (warm-up + cosine) against its
closed form at every step, on several optimizers (plain AdamW, ZeRO-1's ShardedOptimizer,
ZeRO-3's inner optimizer) against one process, across a resume, and a resume with another
--lr refused with both values named.
"""

import json
import math
import shutil

import pytest
import torch

from minitrain.data import get_batch
from minitrain.model import GPT, GPTConfig
from minitrain.parallel.schedule import lr_at
from minitrain.train import main

TINY = ["--n-layer", "2", "--n-head", "2", "--d-model", "32", "--vocab-size", "32",
        "--seq-len", "16", "--batch-size", "4", "--no-progress"]
CFG = GPTConfig(vocab_size=32, seq_len=16, n_layer=2, n_head=2, d_model=32)
LR, STEPS, WARMUP, MIN_LR = 3e-3, 6, 2, 1e-4
COSINE = ["--lr", str(LR), "--lr-schedule", "cosine", "--warmup-steps", str(WARMUP),
          "--min-lr", str(MIN_LR), "--steps", str(STEPS)]


def closed_form(step, lr=LR, total=STEPS, warmup=WARMUP, low=MIN_LR, cosine=True):
    """Written apart from lr_at: (1 + cos x) / 2 = cos²(x / 2)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if not cosine:
        return lr
    t = 1.0 if step >= total else (step - warmup) / (total - warmup)
    return low + (lr - low) * math.cos(math.pi * t / 2) ** 2


def reference(steps=STEPS):
    """One process: the dense GPT, AdamW with the closed-form rate set before each step."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = closed_form(step)
        x, y = get_batch(step, 4, vocab_size=32, seq_len=16, seed=0)
        opt.zero_grad(set_to_none=True)
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _log(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh]


@pytest.mark.parametrize("case", [
    dict(lr=1.0, total=10, warmup=3, low=0.1, cosine=True),
    dict(lr=2e-3, total=7, warmup=0, low=0.0, cosine=True),
    dict(lr=1e-3, total=5, warmup=5, low=1e-4, cosine=True),  # all warm-up
    dict(lr=1e-3, total=9, warmup=4, low=1e-4, cosine=False),
])
def test_lr_at_equals_the_closed_form_at_every_step(case):
    kind = "cosine" if case["cosine"] else "constant"
    for step in range(case["total"] + 2):  # and past the end: stays at min_lr
        got = lr_at(step, case["lr"], case["total"], kind, case["warmup"], case["low"])
        assert got == pytest.approx(closed_form(step, **case), rel=1e-12, abs=1e-15), step
    if case["cosine"]:
        assert lr_at(case["total"], case["lr"], case["total"], kind, case["warmup"],
                     case["low"]) == pytest.approx(case["low"])  # min_lr reached at --steps
    assert lr_at(0, 1.0, 10, "cosine") == 1.0 and lr_at(10, 1.0, 10, "cosine") == pytest.approx(0.1)


def test_schedule_one_process_equals_the_formula_and_the_reference(tmp_path):
    log = tmp_path / "one.jsonl"
    assert main([*TINY, *COSINE, "--log-file", str(log)]) == 0
    recs = _log(log)
    assert [r["lr"] for r in recs] == pytest.approx([closed_form(s) for s in range(STEPS)],
                                                    rel=1e-12)
    assert max(abs(r["loss"] - x) for r, x in zip(recs, reference())) <= 1e-5


@pytest.mark.parametrize("layout", [["--dp", "2", "--zero", "1"], ["--dp", "2", "--zero", "3"],
                                    ["--pp", "2", "--microbatches", "2", "--zero", "1"]],
                         ids=["dp2-zero1", "dp2-zero3", "pp2-zero1"])
def test_schedule_reaches_every_optimizer_and_resumes_exactly(tmp_path, layout):
    """Straight run of 6 steps (checkpoints at 3 and 6) against one process with the
    closed-form rate; then the step-6 checkpoint removed and the run resumed from step 3:
    steps 3-5 must log the very losses and rates of the straight run."""
    common = ["--nproc", "2", *layout, *TINY, *COSINE]
    full, part, ck = tmp_path / "full.jsonl", tmp_path / "part.jsonl", tmp_path / "ck"
    assert main([*common, "--log-file", str(full), "--checkpoint-dir", str(ck),
                 "--checkpoint-every", "3"]) == 0
    a = _log(full)
    assert [r["lr"] for r in a] == pytest.approx([closed_form(s) for s in range(STEPS)],
                                                 rel=1e-12)
    ref = reference()
    assert max(abs(r["loss"] - x) for r, x in zip(a, ref)) <= 1e-5
    shutil.rmtree(ck / f"step_{STEPS:08d}")  # as if stopped after step 3's checkpoint
    assert main([*common, "--log-file", str(part), "--checkpoint-dir", str(ck), "--resume"]) == 0
    b = _log(part)
    assert [r["step"] for r in b] == list(range(3, STEPS))
    assert [(r["loss"], r["lr"]) for r in b] == [(r["loss"], r["lr"]) for r in a[3:]]  # bit for bit


def test_resume_with_other_schedule_flags_names_both_values(tmp_path, capsys):
    ck = tmp_path / "ck"
    common = [*TINY, "--checkpoint-dir", str(ck)]
    assert main([*common, "--steps", "2", "--lr", "1e-3"]) == 0
    capsys.readouterr()
    assert main([*common, "--steps", "4", "--lr", "2e-3", "--resume"]) == 1
    err = capsys.readouterr().err
    assert "--lr = 0.001" in err and "--lr = 0.002" in err, err
    assert main([*common, "--steps", "4", "--warmup-steps", "3", "--resume"]) == 1
    err = capsys.readouterr().err
    assert "--warmup-steps = 0" in err and "--warmup-steps = 3" in err, err
    # the same flags continue (a constant schedule may be extended: --steps is not its length)
    assert main([*common, "--steps", "3", "--lr", "1e-3", "--resume"]) == 0
    ck2 = tmp_path / "ck2"
    cos = [*TINY, "--checkpoint-dir", str(ck2), "--lr-schedule", "cosine"]
    assert main([*cos, "--steps", "2"]) == 0
    capsys.readouterr()
    assert main([*cos, "--steps", "4", "--resume"]) == 1  # the cosine's length changed
    err = capsys.readouterr().err
    assert "--steps (the cosine's length) = 2" in err and "= 4" in err, err


@pytest.mark.parametrize("argv, flag", [(["--warmup-steps", "-1"], "--warmup-steps"),
                                        (["--min-lr", "-1"], "--min-lr"),
                                        (["--dropout", "1.0"], "--dropout"),
                                        (["--lr-schedule", "linear"], "--lr-schedule")])
def test_bad_schedule_values_are_one_clear_error(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*TINY, *argv])
    assert exc.value.code != 0
    assert f"argument {flag}" in capsys.readouterr().err
