"""Record what each rank does and when, and draw it as a per-rank timeline.

Used by notebooks 04 (overlap of all-reduce with backward), 05 (ZeRO-3 gather,
compute, free) and 07 (pipeline bubbles): the pictures are real measurements,
not drawings.

Recording is cheap (two ``perf_counter`` calls and a list append), so it can stay
on in the library code. Each process keeps its own list; ``launch`` returns every
rank's list in ``results.traces``. ``perf_counter`` is the system-wide monotonic
clock on Linux, so the ranks of one machine share a time axis.

Whose clock (issue 41). A GPU runs asynchronously: the host only *queues* kernels, and
NCCL's receives and waits return at once, so host times say when work was queued, not when
it ran (a pipeline's bubble measures ~0, an all-reduce "ends" when it was launched). Code
that times device work names the device: ``span(name, kind, device=x.device)``,
``now(device)``. The device's clock (``CLOCKS``, by device type) then takes the marks: on
CUDA an event recorded on the current stream, turned into a host time only when the events
are read (``events()``, which ``launch`` calls at the end of each rank's run) through one
anchor — the device's work waited for, an anchor event recorded and waited for, the host
clock read right after: the anchor's time on both clocks. Every rank's timeline stays on
the host's axis. Without a device, and on the CPU, a mark is ``perf_counter()`` as before.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

KINDS = ("compute", "communication", "memory", "idle", "other")


@dataclass(frozen=True)
class Event:
    name: str
    kind: str
    start: float  # seconds, time.perf_counter()'s axis (a device mark mapped onto it)
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


# ------------------------------------------------------------------ clocks
class HostClock:
    """The host's clock: a mark is ``time.perf_counter()``, already a time on the axis."""

    def mark(self, device=None) -> float:
        return time.perf_counter()


class DeviceMark:
    """A point in a device's stream (an event recorded there); a time once resolved."""

    __slots__ = ("device", "event")

    def __init__(self, device: torch.device, event):
        self.device, self.event = device, event


class EventClock:
    """An asynchronous device's clock. ``backend``: the device's torch module (``torch.cuda``),
    whose ``Event(enable_timing=True)``, ``current_stream(device)`` and ``synchronize(device)``
    it uses; ``host``: the host clock the marks are mapped onto."""

    def __init__(self, backend, host=time.perf_counter):
        self.backend, self.host = backend, host

    def mark(self, device) -> DeviceMark:
        """An event recorded on ``device``'s current stream: it completes when the device
        gets there, after everything queued before it (a collective a stream waits for too)."""
        event = self.backend.Event(enable_timing=True)
        event.record(self.backend.current_stream(device))
        return DeviceMark(torch.device(device), event)

    def resolve(self, device, events: list) -> list[float]:
        """The host times of ``events`` (recorded on ``device``). One anchor: once the device
        has run everything queued, an anchor event recorded and waited for is passed at the
        host time read right after; an event ``elapsed_time(anchor)`` milliseconds before it
        ran that much earlier. Costs one wait: paid when the events are read, not in a span."""
        self.backend.synchronize(device)
        anchor = self.backend.Event(enable_timing=True)
        anchor.record(self.backend.current_stream(device))
        anchor.synchronize()
        at = self.host()
        return [at - e.elapsed_time(anchor) / 1e3 for e in events]


HOST = HostClock()
# device type -> its clock; a type not listed (cpu, meta) is timed by the host clock
CLOCKS = {"cuda": EventClock(torch.cuda)}


def clock_for(device):
    """The clock of ``device`` (a torch.device, a string or None: the host's)."""
    if device is None:
        return HOST
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return CLOCKS.get(kind, HOST)


# ------------------------------------------------------------------ recording
_events: list[Event] = []
_pending: list[tuple] = []  # (name, kind, start mark, end mark): a mark still on a device
_enabled = True


def reset() -> None:
    """Forget the events recorded so far in this process (launch calls it in every rank)."""
    _events.clear()
    _pending.clear()


def enable(on: bool = True) -> None:
    global _enabled
    _enabled = on


def enabled() -> bool:
    """Whether ``record`` keeps events: code whose measuring itself costs (a callback on a
    communication thread) measures only then."""
    return _enabled


def events() -> list[Event]:
    """A copy of the events recorded in this process, in the order they started (device
    marks are turned into host times now: one wait per device)."""
    _resolve()
    return sorted(_events, key=lambda e: e.start)


def record(name: str, kind: str, start, end) -> None:
    """Record an event measured elsewhere (e.g. an async all-reduce's launch and wait);
    ``start``, ``end``: marks from ``now`` (times, or device marks resolved later)."""
    if kind not in KINDS:
        raise ValueError(f"trace: kind {kind!r} is not one of {KINDS}")
    if _enabled:
        if isinstance(start, DeviceMark) or isinstance(end, DeviceMark):
            _pending.append((name, kind, start, end))
        else:
            _events.append(Event(name, kind, start, end))


def now(device=None):
    """A mark of this moment on ``device``'s clock (see the module docstring): a time on the
    host clock, a ``DeviceMark`` on an event clock. Untraced, always the host's (cheap:
    ``record`` keeps nothing then)."""
    if device is None or not _enabled:
        return time.perf_counter()
    return clock_for(device).mark(device)


@contextmanager
def span(name: str, kind: str = "compute", device=None):
    """``with span("forward", "compute", x.device): ...`` records the time the block takes
    on ``x.device`` (default: the host)."""
    start = now(device)
    try:
        yield
    finally:
        record(name, kind, start, now(device))


def end_mark(work, device=None):
    """A future of the mark at which the asynchronous collective ``work`` ends (RuntimeError
    if its backend gives no future). Its callback runs when the backend completes the future:
    gloo, when the collective is done; NCCL, when it is *queued* — but on streams that wait
    for it, so a device mark taken there (an event) is its end on the device. ``device``:
    where its tensors live (default: read from the future's value)."""
    def ended(fut):
        if device is None and _enabled:
            return now(_device_of(fut.value()))
        return now(device)

    return work.get_future().then(ended)


def _device_of(value):
    for t in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(t, torch.Tensor):
            return t.device
    return None


def _resolve() -> None:
    """Turn the pending device marks into host times, one anchor per device."""
    if not _pending:
        return
    marks: dict = {}
    for _, _, start, end in _pending:
        for m in (start, end):
            if isinstance(m, DeviceMark):
                marks.setdefault(m.device, {})[id(m)] = m
    times = {}
    for device, by_id in marks.items():
        ms = list(by_id.values())
        resolved = clock_for(device).resolve(device, [m.event for m in ms])
        times.update(zip((id(m) for m in ms), resolved, strict=True))
    for name, kind, start, end in _pending:
        _events.append(Event(name, kind, times.get(id(start), start), times.get(id(end), end)))
    _pending.clear()


def overlap_seconds(a: list[Event], b: list[Event]) -> float:
    """Total time during which some event of ``a`` and some event of ``b`` both run."""
    total = 0.0
    for x in _merge(a):
        for y in _merge(b):
            total += max(0.0, min(x[1], y[1]) - max(x[0], y[0]))
    return total


def _merge(evs: list[Event]) -> list[tuple[float, float]]:
    """Union of the events' intervals as disjoint (start, end) pairs."""
    out: list[list[float]] = []
    for e in sorted(evs, key=lambda e: e.start):
        if out and e.start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e.end)
        else:
            out.append([e.start, e.end])
    return [(s, t) for s, t in out]


COLORS = {
    "compute": "#4C72B0",
    "communication": "#DD8452",
    "memory": "#55A868",
    "idle": "#CCCCCC",
    "other": "#8172B2",
}


def plot_timeline(traces: list[list[Event]], ax=None, title: str | None = None):
    """Draw a Gantt chart: one row per rank, one bar per event, coloured by kind.

    ``traces[r]`` is rank r's list of events (``launch(...).traces``). Times are shown in
    milliseconds from the earliest event of any rank. Returns the matplotlib Axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 + 0.5 * len(traces)))
    t0 = min((e.start for evs in traces for e in evs), default=0.0)
    kinds_seen = set()
    for rank, evs in enumerate(traces):
        for e in evs:
            # communication drawn in the lower half of the row, compute in the upper,
            # so overlapping events stay visible
            y = rank if e.kind == "communication" else rank - 0.4
            ax.broken_barh(
                [((e.start - t0) * 1e3, e.duration * 1e3)],
                (y, 0.4),
                facecolors=COLORS.get(e.kind, "#888888"),
                edgecolor="white",
                lw=0.3,
            )
            kinds_seen.add(e.kind)
    ax.set_yticks(range(len(traces)))
    ax.set_yticklabels([f"rank {r}" for r in range(len(traces))])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("process (rank)")
    if title:
        ax.set_title(title)
    ax.legend(
        handles=[Patch(color=COLORS[k], label=k) for k in KINDS if k in kinds_seen],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),  # outside the axes, never over the bars
        fontsize="small",
    )
    return ax
