"""How the launcher's parent learns that a rank failed, died or hangs, and names the rank.

Used by ``minitrain/runtime/launch.py`` (``launch`` waits for its ranks with ``wait_for_ranks``) and,
through it, by every multi-process notebook from 00_getting_started on: a mistake in a rank
function is a ``LaunchError`` naming the rank, never a hang. Importable from
``minitrain.runtime`` as before (``from minitrain.runtime import LaunchError``).

Why this way: a rank that raises sends its traceback text (and what it printed) through its
pipe (``minitrain.runtime.rank.rank_main``); one that dies sends nothing, so its process sentinel
says so; one that is stuck past the timeout is asked for its Python stack (faulthandler
on SIGUSR1, written to a file), so the error shows the collective or recv it waits in.
Stop signals (SIGINT, SIGTERM) and the launcher's helpers: ``stopping.py``.
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import os
import signal
import time


class LaunchError(RuntimeError):
    """A rank failed, died or got stuck. ``.ranks`` lists the ranks at fault."""

    def __init__(self, message: str, ranks: list[int], error_type: str = "", error_text: str = ""):
        super().__init__(message)
        self.ranks = ranks
        # what the rank raised: its class (module.qualname) and str(), for one-line reports
        self.error_type, self.error_text = error_type, error_text


def wait_for_ranks(procs, conns, timeout, stack_dir):
    """Wait for every rank's message; turn the first failure, death or the timeout into LaunchError."""
    deadline = time.monotonic() + timeout
    messages: dict[int, tuple] = {}
    waiting = {conns[r]: r for r in range(len(procs))}
    sentinels = {procs[r].sentinel: r for r in range(len(procs))}
    while waiting:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            stuck = sorted(waiting.values())
            stacks = _stacks_of(procs, stuck, stack_dir)
            raise LaunchError(
                f"rank{'s' if len(stuck) > 1 else ''} {', '.join(map(str, stuck))} did not finish "
                f"within the {timeout:g} s timeout (stuck in a collective or a recv nobody sends?)."
                f"{stacks}",
                stuck,
            )
        ready = mpc.wait(list(waiting) + list(sentinels), timeout=remaining)
        for obj in ready:
            if obj in waiting:
                rank = waiting.pop(obj)
                try:
                    msg = obj.recv()
                except EOFError:  # the process ended without sending anything
                    procs[rank].join(timeout=1.0)
                    raise LaunchError(_death_message(rank, procs[rank].exitcode, stack_dir),
                                      [rank]) from None
                messages[rank] = msg
                sentinels.pop(procs[rank].sentinel, None)
                if msg[0] == "error":
                    raise _raised(rank, msg, waiting)
            elif obj in sentinels:
                rank = sentinels.pop(obj)
                if rank in waiting.values() and not conns[rank].poll():
                    raise LaunchError(_death_message(rank, procs[rank].exitcode, stack_dir),
                                      [rank])
    return messages


def _raised(rank, msg, waiting, grace: float = 0.2) -> LaunchError:
    """The error for ranks that raised: wait ``grace`` seconds for other ranks' reports, then
    show the traceback of the rank that failed first — its peers often fail only because it
    died ("connection closed"). Ranks that failed the same way within a few milliseconds
    (the same bug everywhere) count as one: the lowest of them is shown, so the message does
    not depend on which process happened to be scheduled first."""
    failed = {rank: msg}
    for conn in mpc.wait(list(waiting), timeout=grace):
        try:
            other = conn.recv()
        except EOFError:
            continue
        if other[0] == "error":
            failed[waiting[conn]] = other

    def kind(m):  # the exception's type, from the traceback's last line
        return m[2].strip().splitlines()[-1].split(":")[0]

    origin = min(failed.values(), key=lambda m: m[5])
    first = min(r for r, m in failed.items() if kind(m) == kind(origin) and m[5] - origin[5] < 0.05)
    text, printed = failed[first][2], failed[first][4]
    kind_name, kind_text = failed[first][6] if len(failed[first]) > 6 else ("", "")
    return LaunchError(
        f"rank {first} raised an exception:\n{text}"
        + (f"\nIt printed:\n{printed}" if printed.strip() else ""),
        [first],
        kind_name,
        kind_text,
    )


def _death_message(rank: int, code, stack_dir: str | None = None) -> str:
    """The rank, how it died, and the last lines it wrote to its file descriptors 1 and 2
    (``rank.capture_file_descriptors``: an abort's or a segfault's own words are there)."""
    how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    said = ""
    if stack_dir is not None:
        try:
            with open(os.path.join(stack_dir, f"rank{rank}.out"), errors="replace") as fh:
                tail = fh.read().strip().splitlines()[-20:]
        except OSError:
            tail = []
        said = "".join(f"\n[rank {rank}] {line}" for line in tail)
    return f"rank {rank} died ({how}) before returning a result" + (
        f"; its last output:{said}" if said else "")


def _stacks_of(procs, ranks, stack_dir) -> str:
    """Ask stuck ranks for their Python stack (faulthandler on SIGUSR1) and format it."""
    for r in ranks:
        if procs[r].is_alive():
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(0.3)
    parts = []
    for r in ranks:
        try:
            with open(os.path.join(stack_dir, f"rank{r}.stack")) as fh:
                text = fh.read().strip()
        except OSError:
            text = ""
        # keep the learner's frames: drop the launcher and multiprocessing ones below them
        text = "\n".join(
            line
            for line in text.splitlines()
            if "multiprocessing" not in line and "<string>" not in line and "rank_main" not in line
        )
        if text:
            parts.append(f"\n\nrank {r} was waiting here:\n{text}")
    return "".join(parts)
