"""``make test``'s checks in lanes that run at the same time, each lane's steps in turn.

    python tests/run_checks.py "unit" "grade-verify nbval browser"

Each argument is a lane: make targets run one after the other. The lanes run at once, so on
two cores the unit tests share the machine with the graded tests, the notebooks and the
browser instead of waiting for them (issue 33: from 29 to under 15 minutes). Every step's
output goes to ``test-logs/<target>.log``; the terminal gets one line per step as it ends
(passed or FAILED, and its time), the tail of a failed step's log, and a summary of the times
— the breakdown to look at when the suite grows slow. The exit status is non-zero when any
step failed; a lane stops at its first failure, the others finish.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "test-logs"  # git-ignored
TAIL = 60  # lines of a failed step's log shown in the terminal


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


class Lanes:
    def __init__(self, lanes: list[list[str]]):
        self.lanes = lanes
        self.results: dict[str, tuple[int, float]] = {}
        self.lock = threading.Lock()
        self.start = time.monotonic()

    def say(self, text: str) -> None:
        with self.lock:
            print(text, flush=True)

    def run_lane(self, targets: list[str]) -> None:
        for target in targets:
            log = LOGS / f"{target}.log"
            t0 = time.monotonic()
            with open(log, "w") as out:
                rc = subprocess.call(["make", "--no-print-directory", target], cwd=ROOT,
                                     stdout=out, stderr=subprocess.STDOUT, env=os.environ)
            seconds = time.monotonic() - t0
            self.results[target] = (rc, seconds)
            at = _minutes(time.monotonic() - self.start)
            if rc == 0:
                self.say(f"[{at}] {target}: passed in {_minutes(seconds)} (log: {log.relative_to(ROOT)})")
                continue
            tail = log.read_text(errors="replace").splitlines()[-TAIL:]
            self.say(f"[{at}] {target}: FAILED (exit {rc}) after {_minutes(seconds)}; the end of "
                     f"{log.relative_to(ROOT)}:\n" + "\n".join("    " + line for line in tail))
            return  # this lane's later steps would only repeat the failure's cost

    def run(self) -> int:
        LOGS.mkdir(exist_ok=True)
        self.say("running at once: " + " | ".join(" → ".join(lane) for lane in self.lanes))
        threads = [threading.Thread(target=self.run_lane, args=(lane,)) for lane in self.lanes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        total = time.monotonic() - self.start
        ran = [t for lane in self.lanes for t in lane if t in self.results]
        skipped = [t for lane in self.lanes for t in lane if t not in self.results]
        failed = [t for t in ran if self.results[t][0] != 0]
        self.say("times: " + ", ".join(f"{t} {_minutes(self.results[t][1])}" for t in ran)
                 + f"; all, at once: {_minutes(total)}")
        if skipped:
            self.say("not run (a step before it in its lane failed): " + ", ".join(skipped))
        if failed:
            self.say("FAILED: " + ", ".join(failed))
            return 1
        return 0


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    return Lanes([lane.split() for lane in argv]).run()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
