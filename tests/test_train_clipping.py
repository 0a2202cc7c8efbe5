"""Issue 28: ``--clip-grad-norm`` and ``grad_norm`` on the composed layouts (chapter 11).

The reference is independent of the code under test: the dense GPT on one process, the whole
global batch, ``torch.nn.utils.clip_grad_norm_`` (with max_norm = inf when clipping is off:
it still returns the norm). Every layout's losses must equal it within 1e-5 and its logged
``grad_norm`` (before clipping) within 1e-4 relative — a LayerNorm counted t times, or DP
replicas added, change the norm and so the clipped update. SGD (lr 1) shows a wrong scale
that AdamW's m / sqrt(v) would partly hide; AdamW runs too. Launches are shared: one 4-rank
and one 2-rank launch run every layout.
"""

import json
import math

import pytest
import torch

from minitrain.data import get_batch
from minitrain.model import GPT, GPTConfig
from minitrain.parallel import ParallelGPT
from minitrain.runtime import launch
from minitrain.train import main

CFG = GPTConfig(vocab_size=32, seq_len=16, n_layer=2, n_head=4, d_model=32)
BATCH, SEED, STEPS = 8, 0, 4
CLIP = 0.5  # below every observed norm of these runs (0.77 .. 1.54): clipping is active
LR = {"sgd": 1.0, "adamw": 1e-3}
OPT = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}


def reference(clip: float, optimizer: str, steps: int = STEPS):
    """(losses, norms) of the dense GPT on one process, clipped by torch's own function."""
    torch.manual_seed(SEED)
    model = GPT(CFG)
    opt = OPT[optimizer](model.parameters(), lr=LR[optimizer])
    losses, norms = [], []
    for step in range(steps):
        x, y = get_batch(step, BATCH, vocab_size=CFG.vocab_size, seq_len=CFG.seq_len, seed=SEED)
        opt.zero_grad(set_to_none=True)
        loss = model.loss(x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else math.inf)
        opt.step()
        losses.append(loss.item())
        norms.append(norm.item())
    return losses, norms


def _train(runs):
    """On every rank: each (layout, clip) for STEPS steps; (losses, grad_norms) per run."""
    out = []
    for layout, clip in runs:
        job = ParallelGPT(CFG, layout, BATCH, LR[layout["optimizer"]], SEED, clip_grad_norm=clip)
        losses, norms = [], []
        for step in range(STEPS):
            losses.append(job.step(step))
            norms.append(job.last_metrics["grad_norm"])
        out.append((losses, norms))
    return out


RUNS4 = {  # name -> (layout, max norm)
    "dp2xtp2-sgd": (dict(dp=2, tp=2, optimizer="sgd"), CLIP),
    "dp2xtp2-adamw": (dict(dp=2, tp=2, optimizer="adamw"), CLIP),
    "tp2xpp2-sgd": (dict(tp=2, pp=2, microbatches=2, optimizer="sgd"), CLIP),
    "tp2xpp2-gpipe-adamw": (dict(tp=2, pp=2, microbatches=2, schedule="gpipe",
                                 optimizer="adamw"), CLIP),
    "dp2xtp2-zero3-sgd": (dict(dp=2, tp=2, zero=3, optimizer="sgd"), CLIP),
    "dp2xpp2-zero1-sgd": (dict(dp=2, pp=2, zero=1, microbatches=2, optimizer="sgd"), CLIP),
    "cp2xtp2-sp-sgd": (dict(cp=2, tp=2, sequence_parallel=True, optimizer="sgd"), CLIP),
}
RUNS2 = {
    "dp2-sgd": (dict(dp=2, optimizer="sgd"), CLIP),
    "dp2-zero3-sgd": (dict(dp=2, zero=3, optimizer="sgd"), CLIP),
    "dp2-zero3-adamw": (dict(dp=2, zero=3, optimizer="adamw"), CLIP),
    "tp2-sp-sgd": (dict(tp=2, sequence_parallel=True, optimizer="sgd"), CLIP),
    "tp2-sp-adamw": (dict(tp=2, sequence_parallel=True, optimizer="adamw"), CLIP),
    "dp2-zero1-sgd-off": (dict(dp=2, zero=1, optimizer="sgd"), 0.0),  # grad_norm, no clipping
    "tp2-sgd-off": (dict(tp=2, optimizer="sgd"), 0.0),
}


def _launch(runs, world):
    """name -> every rank's (losses, norms)."""
    per_rank = launch(_train, world, list(runs.values()), timeout=600)
    return {name: [r[k] for r in per_rank] for k, name in enumerate(runs)}


@pytest.fixture(scope="module")
def results4():
    return _launch(RUNS4, 4)


@pytest.fixture(scope="module")
def results2():
    return _launch(RUNS2, 2)


def test_clipping_is_active_in_the_reference():
    for optimizer in LR:
        clipped, norms = reference(CLIP, optimizer)
        free, _ = reference(0.0, optimizer)
        assert min(norms) > CLIP  # every step clipped
        # 10 × the tolerance (AdamW nearly cancels a uniform scale; SGD far more)
        assert max(abs(a - b) for a, b in zip(clipped[1:], free[1:])) > 1e-4


@pytest.mark.parametrize("name", list(RUNS4) + list(RUNS2))
def test_layout_equals_one_process_clip_grad_norm(request, name):
    # only the launch this layout needs (a test run naming one layout starts one launch)
    results = request.getfixturevalue("results4" if name in RUNS4 else "results2")
    layout, clip = {**RUNS4, **RUNS2}[name]
    ref_losses, ref_norms = reference(clip, layout["optimizer"])
    free_losses, _ = reference(0.0, layout["optimizer"])
    for losses, norms in results[name]:  # every rank reports the same numbers
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, (losses, ref_losses)
        for got, want in zip(norms, ref_norms):
            assert abs(got - want) <= 1e-4 * want, (norms, ref_norms)
        if clip:  # and clipping changed the run
            assert max(abs(a - b) for a, b in zip(losses[1:], free_losses[1:])) > 1e-4


def _cli(tmp_path, *flags):
    log = tmp_path / "log.jsonl"
    argv = ["--steps", "3", "--batch-size", str(BATCH), "--seq-len", str(CFG.seq_len),
            "--n-layer", str(CFG.n_layer), "--n-head", str(CFG.n_head),
            "--d-model", str(CFG.d_model), "--vocab-size", str(CFG.vocab_size),
            "--lr", str(LR["adamw"]), "--no-progress", "--log-file", str(log), *flags]
    assert main(argv) == 0
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.parametrize("clip", [0.0, CLIP])
def test_command_logs_grad_norm_on_every_line(tmp_path, clip):
    records = _cli(tmp_path, "--clip-grad-norm", str(clip))
    losses, norms = reference(clip, "adamw", steps=3)
    assert [r["step"] for r in records] == [0, 1, 2]
    for rec, loss, norm in zip(records, losses, norms):
        assert abs(rec["loss"] - loss) < 1e-5
        assert abs(rec["grad_norm"] - norm) <= 1e-4 * norm


def test_negative_clip_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--clip-grad-norm", "-1"])
    assert exc.value.code != 0
    assert "--clip-grad-norm -1" in capsys.readouterr().err


def test_parallel_gpt_refuses_a_negative_clip():
    with pytest.raises(ValueError, match="clip_grad_norm"):
        ParallelGPT(CFG, {}, BATCH, 1e-3, SEED, clip_grad_norm=-0.5)
