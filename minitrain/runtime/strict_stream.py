"""The strict canary's stream: one helper thread per rank running point-to-point operations in
issue order, each send waiting for its receiver (``strict_p2p.py`` explains the model and
installs it; this file is its machinery).

Why a thread: NCCL's stream executes a rank's operations one after the other while the host
goes on; a thread that takes groups of operations off a queue and runs them with gloo's own
``isend``/``irecv``, one group at a time, behaves the same. Why that is enough for "no
buffering": gloo completes a send only once its receive is *posted* (a rendezvous, even for
4 bytes — measured, and checked end to end by tests/test_strict_p2p.py), and the stream posts a
receive only when it *reaches* it, which is when NCCL would let the data move. One tag for
every message: gloo then matches a pair's messages in issue order, as NCCL does (NCCL
documentation, "Point-to-point communication" and "Group calls").
"""

from __future__ import annotations

import os
import queue
import sys
import threading

import torch
import torch.distributed as dist

DATA_TAG = 41_000  # the one tag the canary sends on: the user's tags are ignored
_HERE = (os.path.dirname(os.path.abspath(__file__)) + os.sep + "strict_",
         os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.__file__) + os.sep)


class StrictP2PTimeout(RuntimeError):
    """A point-to-point operation did not complete within the strict timeout: on NCCL, most
    likely a hang (a receive blocking the stream ahead of the send it waits for)."""


def _call_site() -> str:
    """Where the course's (or a learner's) code issued the operation: the innermost frame
    outside the canary, torch and the standard library."""
    frame = sys._getframe(2)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_HERE):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


class Operation:
    """One send or receive on the stream: what, with whom, issued where; done or failed."""

    def __init__(self, kind: str, tensor: torch.Tensor, peer: int, group, name: str):
        self.kind, self.tensor, self.peer, self.group, self.name = kind, tensor, peer, group, name
        self.site = _call_site()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._futures: list = []
        self._lock = threading.Lock()

    def describe(self) -> str:
        way = "to" if self.kind == "send" else "from"
        return (f"{self.name} {way} rank {self.peer} ({tuple(self.tensor.shape)} "
                f"{self.tensor.dtype}, issued at {self.site})")

    def future(self) -> torch.futures.Future:
        fut = torch.futures.Future()
        with self._lock:
            if not self.done.is_set():
                self._futures.append(fut)
                return fut
        self._settle(fut)
        return fut

    def finish(self, error: BaseException | None) -> None:
        with self._lock:
            self.error = error
            self.done.set()
            futures, self._futures = self._futures, []
        for fut in futures:
            self._settle(fut)

    def _settle(self, fut) -> None:
        if self.error is not None:
            fut.set_exception(self.error)
        else:
            fut.set_result([self.tensor])


class Work:
    """What ``isend``/``irecv``/``batch_isend_irecv`` return under the canary: torch's ``Work``
    methods, ``wait()`` waiting for this operation (and its group) on the stream."""

    def __init__(self, op: Operation, stream: Stream):
        self._op, self._stream = op, stream

    def wait(self, timeout=None) -> bool:
        limit = self._stream.timeout
        if timeout is not None and timeout.total_seconds() > 0:
            limit = min(limit, timeout.total_seconds())
        if not self._op.done.wait(limit):
            raise StrictP2PTimeout(self._stream.stuck_message(self._op, limit))
        if self._op.error is not None:
            raise RuntimeError(f"strict point-to-point: {self._op.describe()} failed: "
                               f"{self._op.error}") from self._op.error
        return True

    def is_completed(self) -> bool:
        return self._op.done.is_set()

    def is_success(self) -> bool:
        return self._op.done.is_set() and self._op.error is None

    def exception(self):
        return self._op.error

    def source_rank(self) -> int:
        return self._op.peer

    def result(self) -> list:
        return [self._op.tensor]

    def get_future(self) -> torch.futures.Future:
        return self._op.future()


class Stream:
    """This rank's one stream: groups of operations run in issue order on a helper thread."""

    def __init__(self, isend, irecv, timeout: float):
        self._isend, self._irecv, self.timeout = isend, irecv, timeout
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.current: list[Operation] = []  # the group being executed (for the error message)
        self.state = "is idle"  # what the stream waits for right now
        self.broken: BaseException | None = None  # a failed group fails every later one too

    def submit(self, ops: list[Operation]) -> list[Work]:
        with self._lock:  # one order even when two threads issue (DDP's helper thread)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="minitrain-p2p-stream",
                                                daemon=True)
                self._thread.start()
            self._queue.put(ops)
        return [Work(op, self) for op in ops]

    def stuck_message(self, op: Operation, limit: float) -> str:
        rank = dist.get_rank() if dist.is_initialized() else "?"
        group = "" if len(self.current) < 2 else (
            f" (in one group with: {'; '.join(o.describe() for o in self.current if o is not op)})")
        return (
            f"rank {rank}: {op.describe()} did not complete within {limit:g} s under "
            f"MINITRAIN_P2P=strict (NCCL's point-to-point semantics).\nRank {rank}'s stream "
            f"{self.state}{group}; {self._queue.qsize()} more operation group(s) queued behind."
            "\nOn NCCL a rank's operations run one at a time in issue order and a send waits "
            "until its receiver reaches the matching receive, so a receive issued ahead of the "
            "send it waits for (irecv then isend to the same peer), or a ring of blocking sends, "
            "hangs. Issue matching sends and receives together in one "
            "dist.batch_isend_irecv([...]) (an NCCL group), or order them so that every send "
            "meets a receive its peer has already reached."
        )

    # ----------------------------------------------------------------- the helper thread
    def _run(self) -> None:
        while True:
            ops = self._queue.get()
            self.current, error = ops, self.broken
            try:
                if error is None:
                    self._execute(ops)
            except BaseException as exc:  # noqa: BLE001 — handed to every waiter of the group
                error = self.broken = exc
            finally:
                self.current, self.state = [], "is idle"
                for op in ops:
                    op.finish(error)

    def _execute(self, ops: list[Operation]) -> None:
        """One NCCL group: its operations posted together, then each waited for. Posted only
        now that the stream has reached them, and gloo completes no send before the matching
        receive is posted (a rendezvous: measured from 4 B to 256 MiB), so a send
        completes only once the peer's stream has reached its receive — NCCL's no-buffering."""
        posted = [(op, (self._isend if op.kind == "send" else self._irecv)(
            op.tensor, op.peer, op.group, DATA_TAG)) for op in ops]
        for op, work in posted:
            self.state = (f"waits for rank {op.peer}'s stream to reach the receive matching its "
                          f"{op.describe()}" if op.kind == "send" else
                          f"waits for the data of its {op.describe()}: rank {op.peer}'s stream "
                          "has not reached the matching send")
            work.wait()
