"""Measuring chapter 4: step time and overlap of the DataParallel variants next to torch DDP.

Used by notebooks/04_collectives_and_data_parallel.ipynb, its widget (minitrain.widgets.ch04_ddp)
and the benchmark ``python -m minitrain.bench ddp``. The variants take turns step by step,
so a slow moment of the machine hits them all alike; each step's time is the slowest rank's.
torch's ``DistributedDataParallel`` runs beside them as the reference, never inside minitrain.
"""

from __future__ import annotations

import contextlib
import statistics

import torch
import torch.distributed as dist

from minitrain.ddp.data_parallel import DataParallel
from minitrain.model import GPT, GPTConfig, lm_loss
from minitrain.runtime import (
    device_clock,
    get_device,
    launch,
    max_abs_difference,
    median_and_quartiles,
    summarize_step_times,
    trace,
)
from minitrain.runtime.link import use_link
from minitrain.runtime.timing import slowest_rank_times


def hidden_communication_share(events: list[trace.Event]) -> float:
    """Fraction of the communication time (union of the "communication" events) during which
    some "compute" event also ran: the part of the all-reduce hidden behind backward.

    Read from one rank's trace of one step. ``DataParallel`` records backward's compute from
    its first gradient computation to its *last gradient* (not to the end-of-backward
    callback, which only waits), so an all-reduce launched by the last gradient overlaps
    nothing: a flat bucket hides ~0 %, as it should. "idle" events inside backward (a launch
    call that held the caller) are taken out of compute: backward computed nothing then.
    On a GPU every one of these spans is timed by the device's events (``trace``'s event
    clock), so the share is what the device overlapped, not when the host queued it.
    """
    comm = [e for e in events if e.kind == "communication"]
    compute = [e for e in events if e.kind == "compute"]
    # time inside a compute span during which the rank was in fact waiting ("idle" events,
    # e.g. a launch call that blocks) hides nothing: take it out of compute
    idle = [e for e in events if e.kind == "idle"]
    waiting = [
        trace.Event("waiting", "idle", max(k.start, i.start), min(k.end, i.end))
        for k in compute
        for i in idle
        if min(k.end, i.end) > max(k.start, i.start)
    ]
    total = trace.overlap_seconds(comm, comm)  # a set overlaps itself on its union
    hidden = trace.overlap_seconds(comm, compute) - trace.overlap_seconds(comm, waiting)
    return hidden / total if total > 0 else 0.0


def exposed_after_backward(events: list[trace.Event], bucket_bytes: list[int], link,
                           world: int) -> float:
    """From one rank's trace of one step on a modeled ``link``: when backward's compute ended
    and when each bucket's all-reduce was launched, the seconds the all-reduces run past
    backward's end if each takes the link's time (``link_costs.all_reduce_time``), queued one
    behind the other. (The span's own end is when a thread was told, late on a busy CPU.)"""
    from minitrain.runtime.link_costs import all_reduce_time

    end = max(e.end for e in events if e.name == "backward")
    free = 0.0
    for start, name in sorted((e.start, e.name) for e in events if e.kind == "communication"):
        free = max(start, free) + all_reduce_time(bucket_bytes[int(name.split()[-1])], world, link)
    return max(0.0, free - end)


def predicted_gain(result: dict, reference: str, variant: str) -> float:
    """What the traces predict ``variant`` saves per step against ``reference`` on
    ``result["link"]`` (``measure``'s result; seconds): the median over traced steps of the
    difference of their ``exposed_after_backward`` (each the slowest rank's) — the
    communication the timeline no longer shows after backward. Backward's own length is left
    out: tracing stamps each all-reduce's end from a callback that competes with backward for
    Python, a cost of recording that the untraced steps, whose times say whether the
    timeline explains them, do not pay."""
    def per_step(name):
        return [max(exposed_after_backward(ev, result["bucket_bytes"][name], result["link"],
                                           result["world"]) for ev in ranks)
                for ranks in result["step_traces"][name]]
    return statistics.median(a - b for a, b in zip(per_step(reference), per_step(variant)))


def backward_seconds(result: dict, name: str) -> float:
    """The median over ``measure``'s traced steps and ranks of variant ``name``'s "backward"
    compute span (first gradient to last): what a link is sized against."""
    return statistics.median(e.end - e.start for ranks in result["step_traces"][name]
                             for events in ranks for e in events if e.name == "backward")


def hidden_share_per_step(step_traces: list[list[list[trace.Event]]]) -> list[float]:
    """One hidden share per measured step (the mean over ranks): ``step_traces[i][r]`` holds
    rank r's events of step i."""
    return [
        statistics.mean(hidden_communication_share(events) for events in ranks)
        for ranks in step_traces
    ]


def summarize_shares(shares: list[float]) -> dict:
    """Median and spread of per-step shares: {"median", "q1", "q3", "min", "max", "steps"}.

    One step's share moves with what the shared CPU does at that moment; the median over
    steps is the number to quote, the quartiles say how much a single step varies.
    """
    if not shares:
        raise ValueError("summarize_shares needs at least one step")
    median, (q1, q3) = median_and_quartiles(shares, method="inclusive")
    return {
        "median": median,
        "q1": q1,
        "q3": q3,
        "min": min(shares),
        "max": max(shares),
        "steps": len(shares),
    }


TORCH_DDP = "torch DDP"
MODEL = dict(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=256)  # 3.3 M parameters
QUICK_MODEL = dict(vocab_size=128, seq_len=32, n_layer=2, n_head=4, d_model=128)


def _build(name, kwargs, config, bucket_mb):
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    with torch.device(get_device()):  # built where this rank computes
        model = GPT(GPTConfig(**config))
    if name == TORCH_DDP:
        return DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    return DataParallel(model, **{"bucket_cap_mb": bucket_mb, **kwargs})


def _rank_measure(variants, config, bucket_mb, steps, batch, link, reference):
    """Per variant: the step times (this rank) of ``steps`` untraced steps and the trace
    events of as many traced ones; ``link`` a function of backward's seconds: sized first."""
    torch.manual_seed(1 + dist.get_rank())
    models = {name: _build(name, kw, config, bucket_mb) for name, kw in variants.items()}
    first = next(iter(models.values())).module  # every variant starts from these weights
    initial = {k: q.detach().clone() for k, q in first.named_parameters()}
    opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    device = get_device()
    # data on the CPU from the CPU generator (the same numbers on every device), then moved
    x = torch.randint(0, config["vocab_size"], (batch, config["seq_len"]), device="cpu").to(device)
    y = torch.randint(0, config["vocab_size"], (batch, config["seq_len"]), device="cpu").to(device)
    was_tracing = trace.enabled()
    try:
        if callable(link):  # sized to this run's backward, measured here, now (same load)
            link = link(_unmodeled_backward(reference, variants[reference], config, bucket_mb,
                                            x, y))
        with use_link(link) if link is not None else contextlib.nullcontext():
            times, step_events = _take_turns(models, opts, x, y, steps)
    finally:
        trace.enable(was_tracing)  # the rounds turn tracing on and off
    dp = {name: m for name, m in models.items() if name != TORCH_DDP}
    return {"times": times, "events": step_events, "link": link,
            "buckets": {name: len(m.buckets) for name, m in dp.items()},
            "bucket_bytes": {name: [b.buffer.numel() * b.buffer.element_size() for b in m.buckets]
                             for name, m in dp.items()},
            **_parameter_differences(models, initial)}


def _unmodeled_backward(name, kwargs, config, bucket_mb, x, y) -> float:
    """Seconds of variant ``name``'s backward (median of 3 traced steps, a copy of the model,
    no link), the slowest rank's: what ``measure(link=function)`` sizes the link with."""
    model = _build(name, kwargs, config, bucket_mb)
    opts = {name: torch.optim.SGD(model.parameters(), lr=1e-3)}
    _, events = _take_turns({name: model}, opts, x, y, 3)
    seconds = backward_seconds({"step_traces": {name: [events[name]]}}, name)
    agreed = torch.tensor(seconds, dtype=torch.float64, device=get_device())
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # every rank sizes the same link
    return agreed.item()


def _take_turns(models: dict, opts: dict, x, y, steps: int) -> tuple[dict, dict]:
    """Each variant one step per round: {name: step times of the untraced rounds}, {name:
    trace events of each traced round}."""
    device = get_device()
    times = {name: [] for name in models}
    step_events = {name: [] for name in models}
    names = list(models)
    # two warm-up rounds, then timed rounds and traced rounds taking turns: the times come
    # from untraced steps (torch DDP records nothing, and tracing DataParallel's all-reduces
    # has a cost: gradient_bucket.torch_wait), the timelines and hidden shares from traced ones
    for step in range(2 * steps + 2):
        traced = step >= 2 and step % 2 == 1
        # who goes first rotates: no variant always runs right after another's (the caches
        # and the scheduler's state it leaves), torch DDP included
        for name in names[step % len(names):] + names[:step % len(names)]:
            model = models[name]
            dist.barrier()
            trace.reset()
            trace.enable(traced)
            start = device_clock(device)
            with trace.span("forward", "compute", device):  # (a GPU's events: issue 41)
                loss = lm_loss(model(x), y)
            if name == TORCH_DDP:  # torch DDP records nothing itself: time its backward whole
                with trace.span("backward (with communication)", "compute", device):
                    loss.backward()
            else:
                loss.backward()  # DataParallel records backward and each bucket's all-reduce
            with trace.span("optimizer", "compute", device):
                opts[name].step()
                opts[name].zero_grad()
            elapsed = device_clock(device) - start
            if traced:
                step_events[name].append(trace.events())
            elif step >= 2:
                times[name].append(elapsed)
    return times, step_events


def _parameter_differences(models: dict, initial: dict) -> dict:
    """This rank's {"max_diff": {name: largest |parameter - torch DDP's|} (when torch DDP ran),
    "moved": {name: largest |parameter - its initial value|}}: the variants started from the
    same weights and took the same batches, so they must end where torch DDP ends."""
    final = {name: dict(m.module.named_parameters()) for name, m in models.items()}
    reference = final.get(TORCH_DDP)
    diffs, moved = {}, {}
    for name, params in final.items():
        moved[name] = max_abs_difference(params, initial)
        if reference is not None and name != TORCH_DDP:
            diffs[name] = max_abs_difference(params, reference)
    return {"max_diff": diffs, "moved": moved}


def measure(
    variants: dict,
    config=MODEL,
    bucket_mb: float = 1.0,
    steps: int = 10,
    batch: int = 2,
    world: int = 2,
    link=None,
    reference: str = TORCH_DDP,
) -> dict:
    """Run the variants side by side on ``world`` ranks.

    Returns {"step_time": {name: median over steps of the slowest rank's time}, "spread":
    {name: its first and third quartiles}, "step_ratio": {name: median over steps of the
    step's time / ``reference``'s in the same step} (when it runs: the pairs' ratio, which
    a slow moment of the machine moves less than the ratio of the medians), "max_diff":
    {name: largest |parameter - torch DDP's| after the last step, over the ranks} (when torch
    DDP runs), "moved": {name: largest |parameter - initial value|},
    "traces": {name: [events of rank r in its last step]}, "step_traces": {name: [[events of
    rank r in step i] for each step i]}, "hidden_shares": {name: [hidden share of step i]}
    (DataParallel variants only), "buckets": {name: count}}.
    ``variants``: name → DataParallel keyword arguments; the name ``"torch DDP"`` means
    torch's DistributedDataParallel. ``link``: the modeled link the ranks talk over
    (``launch``'s; torch DDP's reducer calls gloo from C++, under it: not modeled), or a
    function backward seconds → link, called with ``reference``'s unmodeled backward measured
    first in the same launch (a link sized to the machine's load of the moment); the link used
    is returned as "link", with "world" and "bucket_bytes" {name: bytes of each bucket}.
    """
    sized = callable(link)  # else the link is launch's, on from the first message
    res = launch(_rank_measure, world, variants, config, bucket_mb, steps, batch,
                 link if sized else None, reference, timeout=600, link=None if sized else link)
    summary = summarize_step_times([r["times"] for r in res])
    if reference in variants:
        slowest = {name: slowest_rank_times([r["times"][name] for r in res]) for name in variants}
        summary["step_ratio"] = {
            name: statistics.median([a / b for a, b in zip(t, slowest[reference], strict=True)])
            for name, t in slowest.items()
        }
    step_traces = {
        name: [[r["events"][name][i] for r in res] for i in range(steps)] for name in variants
    }
    traces = {name: step_traces[name][-1] for name in variants}
    shares = {
        name: hidden_share_per_step(step_traces[name]) for name in variants if name != TORCH_DDP
    }
    return {
        **summary,
        "link": res[0]["link"],
        "world": world,
        "bucket_bytes": res[0]["bucket_bytes"],
        "slowest": {name: slowest_rank_times([r["times"][name] for r in res]) for name in variants},
        "traces": traces,
        "step_traces": step_traces,
        "hidden_shares": shares,
        "buckets": res[0]["buckets"],
        "max_diff": {name: max(r["max_diff"][name] for r in res) for name in res[0]["max_diff"]},
        "moved": {name: max(r["moved"][name] for r in res) for name in variants},
    }
