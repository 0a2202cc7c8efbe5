"""When a message on the modeled link completes: this rank's queues, the senders' finish times
and the ``Work`` an asynchronous call returns (issue 42; ``link.py`` describes the model,
``link_wrap.py`` calls this around every wrapped torch.distributed function).

* **A queue per group and direction** (``reserve``). This rank's link on a group is free again
  at some time; a message starts at max(now, that time) and keeps the link busy until start +
  cost. Sends occupy the outgoing direction, receives the incoming one, a collective both: a
  ring step's send and receive overlap (full duplex), while two all-reduces launched together
  on one group take twice as long as one.
* **A receive completes when its message has arrived**: no earlier than the modeled finish of
  the matching send (``Receive``). The sender pushes that time into the rendezvous store — a
  FIFO per group, sender, receiver and tag, the order in which gloo matches a pair's messages —
  *before* the real send; the receiver pops it once the real data is there. So a pipeline stage
  waiting for its input gets it α + n/β after its peer sent it, however early it posted the
  receive. The clocks compared are CLOCK_MONOTONIC, shared by the processes of one machine.
* **Waits sleep** (``sleep_until``, ``ModeledWork``): never a busy loop, so the cores stay free
  for the computation a message should overlap.
"""

from __future__ import annotations

import collections
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from minitrain.runtime import link_costs, strict_p2p

STAMP_WAIT = 1.0  # s a receiver waits for its sender's stamp (pushed before the data: a race)
PREFIX = "minitrain_link/"

_free: dict = {}  # (group, "out" | "in") -> when that direction of this rank's link is free
_channels: dict = {}  # store key -> _Channel
_lock = threading.Lock()
_late = threading.local()  # .seconds: how late this thread woke from its last modeled wait


def reset() -> None:
    """Forget the queues (a link switched on afresh starts idle)."""
    with _lock:
        _free.clear()
        _channels.clear()


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def sleep_until(t: float) -> None:
    """Sleep (never spin) until ``t``; remember how late the thread woke (see ``reserve``)."""
    delay = t - time.monotonic()
    _late.seconds = 0.0  # no wait, no lateness: a deadline already past is this rank's own time
    if delay > 0:
        time.sleep(delay)
        _late.seconds = max(0.0, time.monotonic() - t)


def reserve(group, directions, cost: float) -> float:
    """Occupy ``directions`` ("out", "in") of this rank's link on ``group`` for ``cost`` seconds
    from when they are all free, or from now; return the finish. "Now" is taken back by how
    late this thread woke from its last modeled wait: on a busy machine a sleeping rank is
    scheduled milliseconds after its deadline, a delay of this machine's, not of the modeled
    one, which a ring's 2(N−1) dependent steps would otherwise add up (the computation done
    since waking is still charged in full). Taken back once: the next message starts from the
    real clock (a lateness kept for every later message let messages end up to 25 ms before
    their modeled time under load)."""
    now = time.monotonic() - getattr(_late, "seconds", 0.0)
    _late.seconds = 0.0
    with _lock:
        start = max(now, *(_free.get((group, d), 0.0) for d in directions))
        for d in directions:
            _free[(group, d)] = start + cost
    return start + cost


# --------------------------------------------------------------- stamps: when a message arrives
def _channel_key(group, src: int, dst: int, tag: int) -> str:
    tag = 0 if strict_p2p.installed() else tag  # the canary ignores tags, as NCCL does
    return f"{PREFIX}{group.group_name}/{src}>{dst}/{tag}"


class _Channel:
    """The receives posted on one (group, sender, receiver, tag), in order, waiting for their
    senders' finish times."""

    def __init__(self, key: str):
        self.key, self.pending, self.lock = key, collections.deque(), threading.Lock()

    def stamp(self, receive) -> None:
        """Give ``receive`` (and every receive posted before it) its sender's finish time."""
        with self.lock:
            while receive.sent is None and self.pending:
                self.pending.popleft().sent = _pop(self.key)


def _channel(group, src: int, dst: int, tag: int) -> _Channel:
    key = _channel_key(group, src, dst, tag)
    with _lock:
        return _channels.setdefault(key, _Channel(key))


def _pop(key: str):
    """The sender's finish time, or False if none comes (a sender the link does not model)."""
    try:
        store = c10d._get_default_store()
        try:
            return float(store.queue_pop(key, block=False))
        except dist.QueueEmptyError:
            store.wait([key], timedelta(seconds=STAMP_WAIT))
            return float(store.queue_pop(key, block=False))
    except (RuntimeError, AttributeError):
        return False


def send(group, link, tensor: torch.Tensor, dst: int, tag: int) -> float:
    """Model a send to global rank ``dst``: reserve the outgoing link, tell the receiver when the
    message will be there; return that time. Call *before* the real send."""
    finish = reserve(group, ("out",), link_costs.p2p_time(nbytes(tensor), link))
    try:
        c10d._get_default_store().queue_push(_channel_key(group, dist.get_rank(), dst, tag),
                                             repr(finish))
    except (RuntimeError, AttributeError):  # a store without queues: the receiver falls back
        pass
    return finish


class Receive:
    """One modeled receive from global rank ``src`` (None: any source, ``attach`` it later):
    finishes at max(its sender's finish, incoming link free + α + n/β)."""

    def __init__(self, group, link, tensor: torch.Tensor, src: int | None, tag: int):
        self.group, self.tag = group, tag
        self.cost = link_costs.p2p_time(nbytes(tensor), link)
        self.sent = self.finish = self.channel = None
        if src is not None:
            self.attach(src)

    def attach(self, src: int) -> None:
        self.channel = _channel(self.group, src, dist.get_rank(), self.tag)
        with self.channel.lock:
            self.channel.pending.append(self)

    def finish_time(self) -> float:
        """Call once the real receive is complete (its sender's stamp is in the store by then).
        Without a stamp the message is costed from now on the incoming link alone."""
        if self.finish is None:
            if self.channel is not None:
                self.channel.stamp(self)
            with _lock:
                free = _free.get((self.group, "in"), 0.0) + self.cost
                self.finish = max(free, self.sent if self.sent else time.monotonic())
                _free[(self.group, "in")] = self.finish
        return self.finish


def finish_of(parts) -> float:
    """The latest finish of ``parts`` (times, or ``Receive``s whose data is in)."""
    return max(p if isinstance(p, float) else p.finish_time() for p in parts)


def _later(fn, *args) -> None:
    """Run ``fn(*args)`` on a timer thread (a daemon: it never holds up the interpreter's exit)."""
    timer = threading.Timer(0, fn, args)
    timer.daemon = True
    timer.start()


class ModeledWork:
    """What an asynchronous call returns while the link is modeled: torch's ``Work`` methods
    (``wait``, ``is_completed``, ``get_future``; the rest are the real Work's), none of them
    completing before the modeled finish of ``parts``."""

    def __init__(self, work, parts: list, tensors: list | None):
        self._work, self._parts, self._tensors, self._future = work, parts, tensors, None
        self._waited, self._wait_lock = False, threading.Lock()

    def _real_wait(self, timeout=None) -> None:
        """The real Work's wait, once: gloo's receive, waited for twice, times out."""
        with self._wait_lock:
            if not self._waited:
                if timeout is None:
                    self._work.wait()
                else:
                    self._work.wait(timeout)
                self._waited = True

    def wait(self, timeout=None) -> bool:
        self._real_wait(timeout)
        sleep_until(finish_of(self._parts))
        return True

    def is_completed(self) -> bool:
        done = self._waited or self._work.is_completed()
        return done and time.monotonic() >= finish_of(self._parts)

    def get_future(self) -> torch.futures.Future:
        """A future completed by a timer thread once the real operation is done (its own future
        completes, or, for gloo's point-to-point Work, which has none, its wait returns) and
        the modeled finish has passed."""
        if self._future is None:
            self._future = fut = torch.futures.Future()

            def settle(real=None):
                try:
                    if real is None:
                        self._real_wait()
                    value = self._tensors if real is None else real.value()
                    sleep_until(finish_of(self._parts))
                    fut.set_result(value)
                except BaseException as exc:  # noqa: BLE001 — handed to the future's waiters
                    fut.set_exception(exc)

            try:
                real = self._work.get_future()
            except RuntimeError:
                real = None
            if real is None:
                _later(settle)
            else:
                real.add_done_callback(lambda f: _later(settle, f))
        return self._future

    def __getattr__(self, name):  # result, exception, source_rank, ...: the real Work's
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._work, name)
