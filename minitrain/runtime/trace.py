"""Record what each rank does and when, and draw it as a per-rank timeline.

Used by notebooks 04 (overlap of all-reduce with backward), 05 (ZeRO-3 gather,
compute, free) and 07 (pipeline bubbles): the pictures are real measurements,
not drawings.

Recording is cheap (two ``perf_counter`` calls and a list append), so it can stay
on in the library code. Each process keeps its own list; ``launch`` returns every
rank's list in ``results.traces``. ``perf_counter`` is the system-wide monotonic
clock on Linux, so the ranks of one machine share a time axis.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

KINDS = ("compute", "communication", "memory", "idle", "other")


@dataclass(frozen=True)
class Event:
    name: str
    kind: str
    start: float  # seconds, time.perf_counter()
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


_events: list[Event] = []
_enabled = True


def reset() -> None:
    """Forget the events recorded so far in this process (launch calls it in every rank)."""
    _events.clear()


def enable(on: bool = True) -> None:
    global _enabled
    _enabled = on


def enabled() -> bool:
    """Whether ``record`` keeps events: code whose measuring itself costs (a callback on a
    communication thread) measures only then."""
    return _enabled


def events() -> list[Event]:
    """A copy of the events recorded in this process, in the order they started."""
    return sorted(_events, key=lambda e: e.start)


def record(name: str, kind: str, start: float, end: float) -> None:
    """Record an event measured elsewhere (e.g. an async all-reduce's launch and wait)."""
    if kind not in KINDS:
        raise ValueError(f"trace: kind {kind!r} is not one of {KINDS}")
    if _enabled:
        _events.append(Event(name, kind, start, end))


@contextmanager
def span(name: str, kind: str = "compute"):
    """``with span("forward", "compute"): ...`` records the time the block takes."""
    start = time.perf_counter()
    try:
        yield
    finally:
        record(name, kind, start, time.perf_counter())


def now() -> float:
    return time.perf_counter()


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
