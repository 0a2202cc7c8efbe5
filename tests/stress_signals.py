"""Issue 30's stress check: N stop signals at random moments to ``python -m minitrain.train
--nproc 2``; each must exit 130/143 with one line and leave no process of the run after 15 s.

Not collected by pytest (minutes). Run it under load, as docs/operations.md says:

    yes > /dev/null & yes > /dev/null &
    PYTHONPATH=$PWD .venv/bin/python tests/stress_signals.py --when starting   # 0.5–12 s in
    PYTHONPATH=$PWD .venv/bin/python tests/stress_signals.py --when training   # after a save
"""

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

TINY = ["--n-layer", "2", "--n-head", "2", "--d-model", "32", "--vocab-size", "16",
        "--seq-len", "16", "--batch-size", "4", "--no-progress"]


def once(ck: str, when: str, rng: random.Random) -> tuple[bool, str]:
    shutil.rmtree(ck, ignore_errors=True)
    p = subprocess.Popen([sys.executable, "-m", "minitrain.train", *TINY, "--nproc", "2", "--dp",
                          "2", "--steps", "100000", "--checkpoint-every", "1", "--checkpoint-dir",
                          ck], env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    start = time.monotonic()
    if when == "starting":
        time.sleep(rng.uniform(0.5, 12.0))
    else:
        need = rng.choice([1, 2, 3])
        while time.monotonic() - start < 120 and not (
                os.path.isdir(ck) and sum(not d.endswith("partial") for d in os.listdir(ck)) >= need):
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.2))
    sig = rng.choice([signal.SIGINT, signal.SIGTERM])
    sent = time.monotonic()
    if sig == signal.SIGINT:
        os.killpg(p.pid, sig)  # Ctrl-C: the whole group
    else:
        os.kill(p.pid, sig)  # a supervisor: the main process only
    try:
        out = p.communicate(timeout=15)[0]
    except subprocess.TimeoutExpired:
        out = "HANG"
    took = time.monotonic() - sent
    ps = subprocess.run(["ps", "-o", "pid=,stat=", "-g", str(p.pid)], capture_output=True, text=True)
    left = [line for line in ps.stdout.splitlines() if line.strip() and "Z" not in line]
    if left:
        os.killpg(p.pid, signal.SIGKILL)
    ok = (out != "HANG" and not left and p.returncode == 128 + sig and "Traceback" not in out
          and len(out.strip().splitlines()) == 1)
    return ok, (f"{signal.Signals(sig).name:7s} at {sent - start:5.1f} s: rc {p.returncode}, exit "
                f"{took:4.1f} s, {len(left)} left  {'ok' if ok else repr(out)}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--when", choices=("starting", "training"), default="training")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng, bad = random.Random(a.seed), 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.runs):
            ok, line = once(os.path.join(tmp, "ck"), a.when, rng)
            bad += not ok
            print(f"{i:3d} {line}", flush=True)
    print(f"{a.runs - bad} of {a.runs} stopped cleanly")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
