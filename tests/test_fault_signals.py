"""Issue 30: signals to ``python -m minitrain.train --nproc 2``, sent by PID to the process
this test started: SIGTERM to the main process only (what systemd or Slurm send), SIGINT to
the whole group (Ctrl-C) while starting and while training, SIGKILL of the launcher. Every
process of the run is gone within 15 s, the exit says so in one line, and the last complete
checkpoint resumes bit-exactly.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from minitrain.parallel import latest_checkpoint
from minitrain.train import main

TINY = ["--n-layer", "2", "--n-head", "2", "--d-model", "32", "--vocab-size", "16",
        "--seq-len", "16", "--batch-size", "4", "--no-progress"]
RUN = [*TINY, "--nproc", "2", "--dp", "2"]


def _start(ck):
    args = [sys.executable, "-m", "minitrain.train", *RUN, "--steps", "100000",
            "--checkpoint-every", "1", "--checkpoint-dir", str(ck)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(args, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_for_checkpoints(ck, n, proc, limit=120.0):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and proc.poll() is None:
        if ck.exists() and sum(not d.endswith(".partial") for d in os.listdir(ck)) >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"no {n} checkpoints within {limit} s")


def _group(pgid) -> list[str]:
    out = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-g", str(pgid)],
                         capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if " Z" not in line[:12]]  # zombies are gone


def _finish(proc, limit=15.0):
    """Wait for the main process and every process of its group (forkserver, ranks, resource
    tracker) for ``limit`` seconds; return (exit status, output, seconds)."""
    start = time.monotonic()
    try:
        out = proc.communicate(timeout=limit)[0]  # EOF: every holder of stdout has exited
        left = _group(proc.pid)
        while left and time.monotonic() - start < limit:
            time.sleep(0.1)
            left = _group(proc.pid)
        assert not left, f"left after {limit} s: {left}"
        return proc.returncode, out, time.monotonic() - start
    finally:
        if _group(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _log(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh]


def _one_line(out: str) -> str:
    lines = out.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out, out
    return lines[0]


def test_sigterm_to_the_main_process_stops_every_rank_and_resume_is_bit_exact(tmp_path):
    ck = tmp_path / "ck"
    proc = _start(ck)
    _wait_for_checkpoints(ck, 2, proc)
    os.kill(proc.pid, signal.SIGTERM)  # the main process only, as a supervisor does
    code, out, _ = _finish(proc)
    assert code == 128 + signal.SIGTERM, out
    line = _one_line(out)
    last = latest_checkpoint(str(ck))
    assert "SIGTERM" in line and last in line, line
    step = int(last.rsplit("_", 1)[1])
    resumed, straight = tmp_path / "r.jsonl", tmp_path / "s.jsonl"
    assert main([*RUN, "--steps", str(step + 2), "--checkpoint-dir", str(ck), "--resume",
                 "--log-file", str(resumed)]) == 0
    assert main([*RUN, "--steps", str(step + 2), "--log-file", str(straight)]) == 0
    got = _log(resumed)
    assert [r["step"] for r in got] == [step, step + 1]
    assert [r["loss"] for r in got] == [r["loss"] for r in _log(straight)][step:]  # bit for bit


@pytest.mark.parametrize("when", ["starting", "training"])
def test_sigint_to_the_group_at_any_moment_stops_the_run(tmp_path, when):
    ck = tmp_path / "ck"
    proc = _start(ck)
    if when == "starting":
        time.sleep(1.0)  # importing torch, starting the forkserver or the ranks
    else:
        _wait_for_checkpoints(ck, 2, proc)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group
    code, out, _ = _finish(proc)
    assert code == 130, out
    assert "SIGINT" in _one_line(out)
    last = latest_checkpoint(str(ck)) if ck.exists() else None
    if when == "training":
        assert last is not None and last in out
        assert main([*RUN, "--steps", str(int(last.rsplit("_", 1)[1]) + 1), "--resume",
                     "--checkpoint-dir", str(ck)]) == 0


def test_sigkill_of_the_launcher_leaves_no_rank(tmp_path):
    """Ranks are children of the forkserver: they notice their launcher is gone (the lifeline
    pipe closes) and exit, and so do the forkserver and the resource tracker."""
    ck = tmp_path / "ck"
    proc = _start(ck)
    _wait_for_checkpoints(ck, 1, proc)
    os.kill(proc.pid, signal.SIGKILL)
    code, _, _ = _finish(proc)
    assert code == -signal.SIGKILL
    assert latest_checkpoint(str(ck)) is not None
