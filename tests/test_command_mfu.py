"""The training command's MFU: the device's peak in the compute dtype, the step timed on the
device's clock (issue 29; minitrain/parallel/command.py, notebook 11's command).

The reference is the formula MFU = tokens/s · FLOPs/token / peak (Chowdhery et al. 2022,
appendix B) from the logged rate and ``flops_per_token``, with the peak an independent number
(the course machine's core: 2 FMA pipes × 8 fp32 lanes × 2 FLOPs × 3.7 GHz).
"""

from __future__ import annotations

import json

import pytest
import torch

import minitrain.parallel.command as command
from minitrain.model import GPTConfig
from minitrain.step import flops_per_token

ARGS = ["--steps", "2", "--n-layer", "2", "--n-head", "2", "--d-model", "32", "--seq-len", "16",
        "--vocab-size", "32", "--batch-size", "4", "--seed", "0", "--no-progress"]
FPT = flops_per_token(GPTConfig(vocab_size=32, seq_len=16, n_layer=2, n_head=2, d_model=32))
CORE = 2 * 8 * 2 * 3.7e9  # the course machine's fp32 peak per core


def _records(tmp_path, *extra):
    log = tmp_path / "log"
    assert command.main([*ARGS, *extra, "--log-file", str(log)]) == 0
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_peak_flops_defaults_to_the_device():
    assert command.build_parser().parse_args([]).peak_flops is None


def test_mfu_on_the_cpu_uses_the_course_machines_core(tmp_path, monkeypatch):
    monkeypatch.setenv("MINITRAIN_DEVICE", "cpu")
    for r in _records(tmp_path):
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * FPT / CORE, rel=1e-3)


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32),
                                              ("bf16", torch.bfloat16)])
def test_mfu_uses_the_devices_peak_in_the_compute_dtype(tmp_path, monkeypatch, precision, dtype):
    # a stand-in GPU: its peak and its clock are recorded (the command asks for both)
    asked, clocks = [], []
    monkeypatch.setattr(command, "get_device", lambda: torch.device("cuda", 3))
    monkeypatch.setattr(command, "peak_flops", lambda d, t: asked.append((d, t)) or 1e12)
    seconds = iter(range(100))
    monkeypatch.setattr(command, "device_clock", lambda d: clocks.append(d) or next(seconds))
    monkeypatch.setenv("MINITRAIN_DEVICE", "cpu")  # the model itself still runs on the CPU
    records = _records(tmp_path, "--precision", precision)
    assert asked == [(torch.device("cuda", 3), dtype)]
    assert clocks == [torch.device("cuda", 3)] * 4  # before and after each of 2 steps
    for r in records:
        assert r["seconds"] == 1  # the stand-in clock advances by 1 per reading
        assert r["mfu"] == pytest.approx(4 * 16 * FPT / 1e12, rel=1e-6)


def test_an_explicit_peak_is_used_as_given(tmp_path, monkeypatch):
    monkeypatch.setattr(command, "peak_flops", lambda *a: pytest.fail("peak_flops asked"))
    for r in _records(tmp_path, "--peak-flops", "1e9"):
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * FPT / 1e9, rel=1e-3)
