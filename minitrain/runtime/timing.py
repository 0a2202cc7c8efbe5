"""Step times measured on several ranks, summarised the one way the course quotes them.

A distributed step ends when its slowest rank does, so step i's time is the maximum over the
ranks of their times for step i. Over the steps, the median is the number to quote and the
first and third quartiles the spread: a slow moment of a shared machine moves the median
little, and the spread shows it happened. Used by ``minitrain.ddp.measure`` and the
benchmarks ``python -m minitrain.bench zero | tp | moe``. ``device_clock(device)`` reads the
clock once the device's queued work is done: what every timing in the course reads (issue 29).
``slowest_rank_seconds(fn, *args)`` times one call on every rank at once and agrees on the
slowest rank's seconds: what the side-by-side benchmarks and the α–β model's fit measure.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


def slowest_rank_times(per_rank: list[list[float]]) -> list[float]:
    """Step i's time: the maximum over the ranks of ``per_rank[r][i]``. A rank with no times
    (one that sat out, as rank 1 while rank 0 runs a one-process reference) is left out."""
    timed = [times for times in per_rank if times]
    if not timed:
        raise ValueError("slowest_rank_times needs the times of at least one rank")
    return [max(step) for step in zip(*timed, strict=True)]


def median_and_quartiles(
    values: list[float], method: str = "exclusive"
) -> tuple[float, tuple[float, float]]:
    """(median, (first quartile, third quartile)) of ``values``; one value is its own spread.
    ``method``: ``statistics.quantiles``'s ("inclusive" keeps the quartiles of shares within
    the range of the values)."""
    if len(values) == 1:
        return values[0], (values[0], values[0])
    q1, _, q3 = statistics.quantiles(values, n=4, method=method)
    return statistics.median(values), (q1, q3)


def summarize_step_times(per_rank: list[dict[str, list[float]]]) -> dict:
    """Per variant, the slowest rank's step times summarised: ``per_rank[r][name]`` holds rank
    r's times of ``name``'s steps. Returns {"step_time": {name: median}, "spread": {name:
    (q1, q3)}}, the variants in the order of rank 0's dict."""
    step_time, spread = {}, {}
    for name in per_rank[0]:
        step_time[name], spread[name] = median_and_quartiles(
            slowest_rank_times([times[name] for times in per_rank])
        )
    return {"step_time": step_time, "spread": spread}


# ------------------------------------------------------------------ reading the clock
def synchronize(device) -> None:
    """Wait until ``device`` has run everything queued on it. A GPU runs kernels
    asynchronously: without this, a timer would stop when the work was *queued*, not done.
    Nothing to wait for on the CPU (so never an unconditional ``torch.cuda.synchronize()``)."""
    device = torch.device(device)
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize(device)


def device_clock(device) -> float:
    """``time.perf_counter()`` once ``device`` has finished its queued work: read it before
    and after what is timed, and the difference is that work's time on any device."""
    synchronize(device)
    return time.perf_counter()


def slowest_rank_seconds(fn, *args, device="cpu", group=None) -> tuple[float, object]:
    """(seconds ``fn(*args)`` took on the slowest rank of ``group``, ``fn``'s result).

    A collective: every rank of ``group`` calls it. The ranks start together (a barrier), each
    reads ``device_clock(device)`` before and after the call, and an all-reduce MAX of the
    elapsed time gives every rank the same number — the slowest rank's, since a distributed op
    ends when its last rank does. The same number everywhere also means that every rank that
    decides something from it (the α–β fit of ``all_reduce(x, "auto")``) decides alike.
    ``device``: where the work runs (the clock waits for it) and the elapsed time is reduced
    (NCCL reduces only GPU tensors)."""
    dist.barrier(group=group)
    start = device_clock(device)
    result = fn(*args)
    elapsed = torch.tensor(device_clock(device) - start, dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return elapsed.item(), result


def timed_spans(fn, reps: int = 5) -> list[tuple[float, float]]:
    """Per repetition, when this rank started and finished ``fn()`` after a barrier (one warm-up
    first), on CLOCK_MONOTONIC, which the processes of one machine share: the raw material of
    ``span_seconds`` (the modeled link's benchmark and tests)."""
    fn()
    spans = []
    for _ in range(reps):
        dist.barrier()
        start = time.monotonic()
        fn()
        spans.append((start, time.monotonic()))
    return spans


def span_seconds(per_rank: list[list[tuple[float, float]]]) -> float:
    """The median over repetitions of the last rank's start → the last rank's end: an operation
    cannot start before its last rank calls it, and a barrier lets ranks go milliseconds apart
    on a loaded machine."""
    return statistics.median(max(end for _, end in spans) - max(start for start, _ in spans)
                             for spans in zip(*per_rank))
