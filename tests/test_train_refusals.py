"""Issue 40, item 5: what ``python -m minitrain.train`` accepted silently, or refused with a
traceback, is now one line naming the flag(s) and a non-zero exit.

- compositions (ZeRO-2/3 with a pipeline, sequence parallelism over a sequence --tp does not
  divide) refused before any rank starts, exit 2;
- combinations that would do nothing or something else (--min-lr above --lr or without the
  cosine, --warmup-steps beyond --steps, a negative --moe-aux-weight, MoE flags without
  --moe-experts — even typed at their default —, --sequence-parallel at --tp 1), exit 2;
- a resume on another --data file or --clip-grad-norm refused; a seed, model or layout
  mismatch names the flag with both values, exit 1;
- a non-finite loss stops the run at that step (one process and --nproc), the log stays JSON,
  no checkpoint of the bad step; fp16 stops when the loss scaler gives up, exit 1.

Parser-level checks call ``main`` in this process (no rank starts); resumes run one process.
"""

import json
import math
import os
import subprocess
import sys

import pytest
from command_output import one_line, refused

from minitrain.parallel import command
from minitrain.parallel.command_errors import MIN_LOSS_SCALE, divergence, json_line
from minitrain.precision.loss_scaling import DynamicLossScaler

TINY = ["--steps", "2", "--n-layer", "1", "--d-model", "16", "--seq-len", "8",
        "--batch-size", "4", "--no-progress"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _refused(argv, capsys) -> str:
    line = refused(command.main, [*TINY, *argv], capsys)
    assert line.startswith("minitrain.train: error: "), line
    return line


def _failed(argv, capsys) -> str:
    """A run that starts and stops with exit 1 and one line (a resume refused, a NaN)."""
    assert command.main([*TINY, *argv]) == 1
    return one_line(capsys.readouterr().err)


# ------------------------------------------------------------ refused before any rank starts
@pytest.mark.parametrize("argv, flags", [
    (["--nproc", "2", "--pp", "2", "--zero", "2", "--n-layer", "2"], ["--pp 2", "--zero 2"]),
    (["--nproc", "2", "--tp", "2", "--sequence-parallel", "--seq-len", "15"],
     ["--sequence-parallel", "--seq-len 15", "--tp 2"]),
], ids=["pp2-zero2", "tp2-sp-seq15"])
def test_compositions_are_refused_before_launch(argv, flags, capsys):
    line = _refused(argv, capsys)
    assert all(f in line for f in flags), line


@pytest.mark.parametrize("argv, flag", [
    (["--lr", "1e-3", "--min-lr", "1e-2", "--lr-schedule", "cosine"], "--min-lr 0.01"),
    (["--min-lr", "1e-4"], "--min-lr"),  # a constant schedule never reaches it
    (["--warmup-steps", "3"], "--warmup-steps 3"),  # --steps 2
    (["--moe-experts", "2", "--moe-aux-weight", "-5"], "--moe-aux-weight -5"),
    (["--moe-top-k", "2"], "--moe-top-k 2"),  # typed at its default: seen all the same
    (["--moe-aux-weight", "0.01"], "--moe-aux-weight"),
    (["--moe-capacity-factor", "1.5"], "--moe-capacity-factor"),
    (["--ep", "1"], "--ep 1"),
    (["--sequence-parallel"], "--sequence-parallel"),
], ids=["min-lr-above-lr", "min-lr-constant", "warmup-beyond-steps", "negative-aux-weight",
        "top-k-without-experts", "aux-weight-without-experts", "capacity-without-experts",
        "ep-without-experts", "sp-at-tp1"])
def test_silent_acceptances_are_refused_naming_the_flag(argv, flag, capsys):
    assert flag in _refused(argv, capsys)


def test_effective_defaults_unchanged_and_edge_values_accepted(monkeypatch):
    """Parser defaults of None are filled in as before (2, none, 0.01, 1; --min-lr 0.1 × --lr);
    the limits themselves are accepted. ``run_reporting`` is stubbed: nothing trains."""
    seen = []

    def no_run(train, args):
        seen.append(dict(args))
        return [{"rank": 0, "records": []}], 0

    monkeypatch.setattr(command, "run_reporting", no_run)
    assert command.main(TINY) == 0
    assert command.main([*TINY, "--warmup-steps", "2", "--lr-schedule", "cosine",
                         "--lr", "1e-3", "--min-lr", "1e-3"]) == 0
    assert command.main([*TINY, "--moe-experts", "2", "--moe-top-k", "2", "--ep", "1",
                         "--moe-aux-weight", "0"]) == 0
    first = seen[0]
    assert (first["moe_top_k"], first["moe_capacity_factor"], first["moe_aux_weight"],
            first["ep"]) == (2, None, 0.01, 1)
    assert first["min_lr"] == pytest.approx(0.1 * first["lr"])


# ------------------------------------------------------------------------------ resuming
def test_resume_on_another_data_file_or_clip_is_refused(tmp_path, capsys):
    text = tmp_path / "a.txt"
    text.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 20)
    other = tmp_path / "b.txt"
    other.write_bytes(text.read_bytes().upper())
    ck = tmp_path / "ck"
    run = [*TINY, "--checkpoint-dir", str(ck), "--clip-grad-norm", "1.0"]
    assert command.main([*run, "--steps", "1", "--data", str(text)]) == 0
    capsys.readouterr()
    resume = [*run, "--resume"]
    line = _failed([*resume, "--data", str(other)], capsys)
    assert "--data = a.txt" in line and "--data = b.txt" in line, line
    line = _failed([*resume[:-3], "--clip-grad-norm", "0.5", "--resume", "--data", str(text)],
                   capsys)
    assert "--clip-grad-norm = 1.0" in line and "--clip-grad-norm = 0.5" in line, line
    text.write_bytes(text.read_bytes()[::-1])  # the same name, other bytes
    line = _failed([*resume, "--data", str(text)], capsys)
    assert "--data" in line and "sha256" in line, line


def test_seed_model_and_layout_mismatches_name_the_flag(tmp_path, capsys):
    ck = tmp_path / "ck"
    assert command.main([*TINY, "--steps", "1", "--checkpoint-dir", str(ck)]) == 0
    capsys.readouterr()
    resume = ["--checkpoint-dir", str(ck), "--resume"]
    line = _failed([*resume, "--seed", "3"], capsys)
    assert "resume with --seed 0" in line and "same layout" not in line, line
    line = _failed([*resume, "--d-model", "32", "--n-head", "2"], capsys)
    assert "--d-model 16 in the checkpoint, 32 now" in line, line
    assert "--n-head 4 in the checkpoint, 2 now" in line and "{" not in line, line
    line = _failed([*resume, "--microbatches", "2"], capsys)
    assert "--microbatches 1 in the checkpoint, 2 now" in line and "{" not in line, line


# ---------------------------------------------------------------------- non-finite losses
def _strict(line: str) -> dict:
    def no_constant(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(line, parse_constant=no_constant)


def test_a_non_finite_loss_stops_every_rank_at_its_step_inone_line(tmp_path):
    """--lr 1e9: step 0 is finite, its update sends the loss of step 1 to NaN. Two ranks
    (the launcher's LaunchError path), as an operator runs it: exit 1, one line."""
    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "minitrain.train", *TINY, "--nproc", "2", "--dp", "2",
         "--steps", "4", "--lr", "1e9", "--checkpoint-dir", str(ck), "--checkpoint-every", "1",
         "--log-file", str(log)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1, proc.stderr
    line = one_line(proc.stderr)
    assert "the loss is not finite at step 1 (nan): stopped" in line, line
    assert line.endswith(os.path.join(str(ck), "step_00000001")), line
    records = [_strict(x) for x in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1] and records[-1]["loss"] is None
    assert math.isfinite(records[0]["loss"])
    assert sorted(os.listdir(ck)) == ["step_00000001"]  # none for the NaN step


def test_a_non_finite_loss_stops_one_process_inone_line(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    line = _failed(["--steps", "4", "--lr", "1e9", "--log-file", str(log)], capsys)
    assert "the loss is not finite at step 1 (nan)" in line and "no --checkpoint-dir" in line
    assert [_strict(x)["loss"] for x in log.read_text().splitlines()][1:] == [None]


def test_fp16_stops_when_the_loss_scaler_gives_up(monkeypatch, capsys):
    """Every step overflows (forced) from a scale of 2**-22: after step 2 it is 2**-25."""
    monkeypatch.setattr(DynamicLossScaler.__init__, "__defaults__", (2.0**-22, 2.0, 0.5, 2000))

    def overflow(self, optimizer, group=None):
        self._found_inf[id(optimizer)] = True
        return True

    monkeypatch.setattr(DynamicLossScaler, "all_reduce_found_inf", overflow)
    line = _failed(["--precision", "fp16", "--steps", "6"], capsys)
    assert "loss scale" in line and "at step 2" in line and "2**-24" in line, line


def test_divergence_rules_and_strict_json():
    assert divergence(3, float("inf"), {}, None).startswith("the loss is not finite at step 3")
    assert "gradient norm" in divergence(4, 1.0, {"grad_norm": float("nan")}, None)
    # with a scaler an overflow is a skipped step, not a divergence — until it gives up
    assert divergence(4, 1.0, {"grad_norm": float("nan")}, 1.0) is None
    assert "given up" in divergence(5, 1.0, {}, MIN_LOSS_SCALE / 2)
    assert divergence(5, 1.0, {}, MIN_LOSS_SCALE) is None
    assert divergence(6, 1.0, {"grad_norm": 2.0}, None) is None
    record = _strict(json_line({"step": 1, "loss": float("nan"), "grad_norm": float("-inf")}))
    assert record == {"step": 1, "loss": None, "grad_norm": None}
