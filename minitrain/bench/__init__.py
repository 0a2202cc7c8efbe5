"""Benchmarks: ``python -m minitrain.bench <name> [options]``.

Each benchmark measures minitrain against its reference (torch's own
implementation, or the plain single-process run) in the same run, on the same
machine, and prints the medians side by side with their ratio. Speed targets are
checked here, never by timed unit tests. ``python -m minitrain.bench`` lists them.
"""

from __future__ import annotations

import statistics
import time


def median_time(fn, repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeats`` runs, after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def print_table(rows: list[dict], columns: list[str]) -> None:
    """Print rows of dicts as an aligned text table (the benchmarks' common output)."""
    widths = {c: max(len(c), *(len(_fmt(r.get(c, ""))) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c, "")).rjust(widths[c]) for c in columns))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)
