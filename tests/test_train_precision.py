"""Issue 28: ``--precision bf16|fp16`` on the composed layouts (chapter 11).

References written here, not the code under test: one process, a bf16 (or fp16) copy of the
dense GPT computing forward and backward, an fp32 master copy stepped by AdamW and copied
back each step (Micikevicius et al. 2018, §3.1), the loss from fp32 logits; and the fp32
run. bf16 must stay finite, within 5e-2 of the bf16 reference and 0.1 of fp32 over 6 steps.
fp16 logs ``loss_scale``, its ``grad_norm`` is of the *unscaled* gradient, and an overflow
seen by one pipeline stage only is skipped by every rank. Resume is bit-exact.
"""

import copy
import io
import json
import math

import pytest
import torch

from minitrain.data import get_batch
from minitrain.model import GPT, GPTConfig, lm_loss
from minitrain.parallel import ParallelGPT, full_layout
from minitrain.runtime import get_device, launch
from minitrain.train import main

CFG = GPTConfig(vocab_size=32, seq_len=16, n_layer=2, n_head=4, d_model=32)
BATCH, SEED, LR, STEPS = 8, 0, 1e-3, 6
CLIP = 0.5


def reference(dtype, steps: int = STEPS, clip: float = 0.0):
    """(losses, norms): a ``dtype`` copy computes, fp32 masters step (AdamW), one process."""
    torch.manual_seed(SEED)
    master = GPT(CFG)
    low = copy.deepcopy(master).to(dtype)
    opt = torch.optim.AdamW(master.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(steps):
        x, y = get_batch(step, BATCH, vocab_size=CFG.vocab_size, seq_len=CFG.seq_len, seed=SEED)
        with torch.no_grad():
            for p, m in zip(low.parameters(), master.parameters()):
                p.copy_(m)
        low.zero_grad(set_to_none=True)
        loss = lm_loss(low(x).float(), y)
        loss.backward()
        for p, m in zip(low.parameters(), master.parameters()):
            m.grad = p.grad.float()
        norm = torch.nn.utils.clip_grad_norm_(master.parameters(), clip if clip else math.inf)
        opt.step()
        losses.append(loss.item())
        norms.append(norm.item())
    return losses, norms


def _train(runs):
    out = []
    for layout, clip in runs:
        job = ParallelGPT(CFG, layout, BATCH, LR, SEED, clip_grad_norm=clip)
        metrics = []
        for step in range(STEPS):
            metrics.append({"loss": job.step(step), **job.last_metrics})
        out.append(metrics)
    return out


RUNS4 = {
    "bf16-dp2xtp2": (dict(dp=2, tp=2, precision="bf16"), 0.0),
    "bf16-tp2xpp2": (dict(tp=2, pp=2, microbatches=2, precision="bf16"), 0.0),
    "bf16-dp2xtp2-zero3": (dict(dp=2, tp=2, zero=3, precision="bf16"), 0.0),
    "bf16-cp2xtp2-sp": (dict(cp=2, tp=2, sequence_parallel=True, precision="bf16"), 0.0),
    "bf16-dp2xpp2-zero1": (dict(dp=2, pp=2, zero=1, microbatches=2, precision="bf16"), 0.0),
    "fp16-dp2xtp2-clip": (dict(dp=2, tp=2, precision="fp16"), CLIP),
    "fp16-dp2xtp2-zero2-clip": (dict(dp=2, tp=2, zero=2, precision="fp16"), CLIP),
    "fp16-tp2xpp2-clip": (dict(tp=2, pp=2, microbatches=2, precision="fp16"), CLIP),
}


@pytest.fixture(scope="module")
def results():
    per_rank = launch(_train, 4, list(RUNS4.values()), timeout=600)
    return {name: [r[k] for r in per_rank] for k, name in enumerate(RUNS4)}


@pytest.mark.parametrize("name", [n for n in RUNS4 if n.startswith("bf16")])
def test_bf16_layout_follows_one_process_bf16(results, name):
    bf16, _ = reference(torch.bfloat16)
    fp32, _ = reference(torch.float32)
    for metrics in results[name]:
        losses = [m["loss"] for m in metrics]
        assert all(math.isfinite(v) for v in losses)
        assert max(abs(a - b) for a, b in zip(losses, bf16)) < 5e-2, (losses, bf16)
        assert max(abs(a - b) for a, b in zip(losses, fp32)) < 0.1
        assert all("loss_scale" not in m and math.isfinite(m["grad_norm"]) for m in metrics)


@pytest.mark.parametrize("name", [n for n in RUNS4 if n.startswith("fp16")])
def test_fp16_logs_the_scale_and_the_unscaled_norm(results, name):
    losses16, norms16 = reference(torch.float16, clip=CLIP)
    for metrics in results[name]:
        assert [m["loss_scale"] for m in metrics] == [2.0**16] * STEPS  # no overflow here
        losses = [m["loss"] for m in metrics]
        assert max(abs(a - b) for a, b in zip(losses, losses16)) < 5e-2
        for m, want in zip(metrics, norms16):  # of the gradient ÷ S, not × 65536
            assert abs(m["grad_norm"] - want) < 2e-2 * want, (m["grad_norm"], want)


def _partial_overflow(candidates):
    """pp=2, fp16: set the scale S so large that one stage's gradients overflow and the
    other's do not; every rank must skip the step and halve S alike."""
    layout = dict(pp=2, precision="fp16")
    for scale in candidates:
        job = ParallelGPT(CFG, layout, BATCH, LR, SEED)
        state = job.scaler.state_dict()
        job.scaler.load_state_dict({**state, "scale": scale})
        before = [m.detach().clone() for m in job.optimizer.master_params]
        job.step(0)
        grads = [m.grad for m in job.optimizer.master_params if m.grad is not None]
        mine = not all(bool(torch.isfinite(g).all()) for g in grads)  # this stage's overflow
        flags = [torch.zeros(2, device=before[0].device) for _ in range(2)]
        mine_t = torch.tensor([float(mine), 0.0], device=before[0].device)
        torch.distributed.all_gather(flags, mine_t)
        if flags[0][0] != flags[1][0]:  # one stage overflowed, the other did not
            same = all(torch.equal(a, m) for a, m in zip(before, job.optimizer.master_params))
            job.step(1)
            return scale, mine, same, job.last_metrics["loss_scale"]
    return None


def test_fp16_skip_is_decided_by_every_rank():
    candidates = [2.0**17 * (1 + i / 16) for i in range(4, 16)]  # 229376 here
    found = launch(_partial_overflow, 2, candidates, timeout=300)
    assert found[0] is not None, "no scale overflowed on one stage only: the test is vacuous"
    for scale, _, unchanged, next_scale in found:
        assert unchanged  # skipped on the stage that saw no overflow, too
        assert next_scale == scale * 0.5  # backed off on every rank
    assert {f[1] for f in found} == {True, False}


def _resume(layout, steps, cut):
    """Straight ``steps`` steps against ``cut`` steps, a state round trip through bytes (as a
    checkpoint file), a fresh job, and the rest: losses and every master bit-equal."""
    straight = ParallelGPT(CFG, layout, BATCH, LR, SEED)
    want = [straight.step(i) for i in range(steps)]
    first = ParallelGPT(CFG, layout, BATCH, LR, SEED)
    got = [first.step(i) for i in range(cut)]
    buffer = io.BytesIO()
    torch.save(first.state(), buffer)
    buffer.seek(0)
    second = ParallelGPT(CFG, layout, BATCH, LR, SEED)
    second.load_state(torch.load(buffer, weights_only=False))
    got += [second.step(i) for i in range(cut, steps)]
    a, b = straight.state(), second.state()
    same = all(torch.equal(x, y) for x, y in zip(a.get("masters", a.get("shards", [])),
                                                 b.get("masters", b.get("shards", []))))
    return got == want, same, a.get("scaler") == b.get("scaler")


@pytest.mark.parametrize("layout", [
    dict(dp=2, precision="bf16"),
    dict(dp=2, zero=3, precision="bf16"),
    dict(pp=2, microbatches=2, precision="bf16"),
    dict(tp=2, precision="fp16"),
], ids=["dp2", "dp2-zero3", "pp2", "tp2-fp16"])
def test_resume_is_bit_exact(layout):
    for losses_equal, masters_equal, scaler_equal in launch(_resume, 2, layout, 4, 2,
                                                            timeout=300):
        assert losses_equal and masters_equal and scaler_equal


def _cli(tmp_path, *flags, log="log.jsonl"):
    path = tmp_path / log
    argv = ["--batch-size", str(BATCH), "--seq-len", str(CFG.seq_len),
            "--n-layer", str(CFG.n_layer), "--n-head", str(CFG.n_head),
            "--d-model", str(CFG.d_model), "--vocab-size", str(CFG.vocab_size),
            "--lr", str(LR), "--no-progress", "--log-file", str(path), *flags]
    assert main(argv) == 0
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_command_fp16_logs_loss_scale_and_resumes_exactly(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    flags = ("--precision", "fp16", "--checkpoint-dir", ckpt, "--checkpoint-every", "2")
    straight = _cli(tmp_path, "--steps", "4", "--precision", "fp16", log="straight.jsonl")
    assert all(r["loss_scale"] == 2.0**16 and "grad_norm" in r for r in straight)
    _cli(tmp_path, "--steps", "2", *flags, log="resumed.jsonl")
    resumed = _cli(tmp_path, "--steps", "4", "--resume", *flags, log="resumed.jsonl")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    fp16, _ = reference(torch.float16, steps=4)
    assert max(abs(r["loss"] - v) for r, v in zip(straight, fp16)) < 5e-2


def test_unknown_precision_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--precision", "fp8"])
    assert exc.value.code != 0
    assert "--precision fp8" in capsys.readouterr().err
    with pytest.raises(ValueError, match="precision"):
        full_layout({"precision": "fp8"})
    assert full_layout({})["precision"] == "fp32"


def _on_meta_default(layouts):
    """With torch's default device set to ``meta``, an allocation that does not name its
    device lands there and fails (no data): the trainer builds and trains anyway."""
    torch.set_default_device("meta")
    out = []
    for layout in layouts:
        job = ParallelGPT(CFG, layout, BATCH, LR, SEED, clip_grad_norm=CLIP)
        devices = {p.device for p in job.model.parameters()} | {job.device}
        out.append(([job.step(i) for i in range(2)], devices, get_device()))
    return out


def test_the_trainer_names_every_device():
    layouts = [dict(dp=2, precision="bf16"), dict(dp=2, zero=3, precision="fp16"),
               dict(dp=2, zero=1, optimizer="sgd")]
    free = launch(_train, 2, [(lo, CLIP) for lo in layouts], timeout=300)[0]
    meta = launch(_on_meta_default, 2, layouts, timeout=300)[0]
    for (losses, devices, device), metrics in zip(meta, free):
        assert devices == {device}  # the rank's device (the CPU here, cuda:r on a GPU machine)
        assert losses == [m["loss"] for m in metrics[:2]]
