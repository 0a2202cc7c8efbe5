"""Measuring a pipeline: timelines, the bubble and activation memory, next to the formulas.

Chapter 7, notebooks/07_pipeline_parallel.ipynb (and its widget and ``python -m
minitrain.bench pipeline``). ``run_pipelines`` launches p ranks once and runs several
schedules on them, each traced with ``minitrain.runtime.trace``, returning per schedule the
timelines, the measured bubble, the predicted one (``check.simulate``), and the peak bytes
autograd held per stage (``minitrain.memory.LiveSavedBytes``; zero bubble's W pairs too) next
to the in-flight formula.
With ``link=`` (issue 42) the ranks' messages go over a modeled link: ``predicted_step`` is
``simulate``'s makespan with each rank's measured action times and α + n/β per message.
Two kinds of stage:
- ``"gpt"``: the course's GPT, real compute. On this 2-core machine p ranks share two cores,
  so compute times depend on the load and the bubble only roughly follows the formula.
- ``"sleep"``: **a calibrated sleep**, not a model: ``SleepGPT`` has the GPT's parts but each
  block's forward sleeps ``unit`` and its backward 2 ``unit`` (zero bubble: B and W one each,
  W in ``SleepStage``),
  the chapter's one cost convention (``check.py``), so the timeline depends on the schedule
  alone, the bubble must match the formula and step times compare across schedules.
  The sleep happens where the stage computes: on a GPU a kernel that spins (a host sleep
  would leave the device idle, and the device-timed trace would show no compute at all).
On a GPU the trace's spans are the device's (``trace``'s event clock, issue 41): host times
would show when work was queued, and NCCL's waits do not block the host.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from minitrain.memory import LiveSavedBytes, saved_activation_bytes
from minitrain.pipeline.check import UNIT, ScheduleError, chunk_costs, dependencies, simulate
from minitrain.pipeline.executor import PipelineStage
from minitrain.pipeline.messages import sent_by
from minitrain.pipeline.schedules import make_schedule
from minitrain.pipeline.sleep_stage import SleepGPT, SleepStage, calibrated_sleep  # noqa: F401
from minitrain.pipeline.weight_grad import LinearCalls, backward_input
from minitrain.runtime import device_clock, get_device, launch, trace
from minitrain.runtime.link_costs import p2p_time

WHOLE_BACKWARD = {"F": 1, "B": 2}  # a schedule without W: B is the whole backward, B + W

def measured_bubble(events_per_rank) -> float:
    """1 - (time every rank computed) / (ranks x span from the first compute to the last)."""
    compute = [[e for e in evs if e.kind == "compute"] for evs in events_per_rank]
    start, end = min(e.start for c in compute for e in c), max(e.end for c in compute for e in c)
    busy = sum(e.duration for evs in compute for e in evs)
    return 1.0 - busy / (len(compute) * (end - start))


def action_seconds(events_per_rank) -> list:
    """Per rank, {(kind, micro-batch, chunk): seconds} of one step's traced F/B/W spans."""
    out = []  # spans are named "F3" or, with chunks, "F3.1" (PipelineStage.forward/backward)
    for evs in events_per_rank:
        spans = {}
        for e in evs:
            if e.kind == "compute" and e.name[:1] in "FBW":
                mb, _, chunk = e.name[1:].partition(".")
                spans[(e.name[0], int(mb), int(chunk or 0))] = e.duration
        out.append(spans)
    return out


def predicted_step(schedule, seconds, message_seconds: float = 0.0, num_chunks: int = 1) -> float:
    """``simulate``'s makespan with real durations and a cost per message: stage s's action
    takes ``seconds[s][(kind, mb, chunk)]`` (``action_seconds``); an input from another rank
    arrives ``message_seconds`` (α + n/β) after it left, a rank's messages leave one after
    another (the link queues them, ``link_messages.reserve``); the step ends when the last
    action has and the last message has arrived. Zero cost, unit durations: ``simulate``'s."""
    p, v = len(schedule), num_chunks
    finish, arrive, position = {}, {}, [0] * p
    free, link_free = [0.0] * p, [0.0] * p
    while any(position[s] < len(schedule[s]) for s in range(p)):
        before = sum(position)
        for s in range(p):
            while position[s] < len(schedule[s]):
                action = schedule[s][position[s]]
                deps, chunk = dependencies(action, s, p, v), action[2] if len(action) > 2 else 0
                if any(d not in finish for d in deps):
                    break
                start = max([free[s]] + [arrive.get(d, finish[d]) for d in deps])
                key = (action[0], action[1], chunk, s)
                finish[key] = free[s] = start + seconds[s][(action[0], action[1], chunk)]
                message = sent_by(action, s, p, v)
                if message is not None and message.to_virtual % p != s:  # leaves the rank
                    link_free[s] = arrive[key] = max(free[s], link_free[s]) + message_seconds
                position[s] += 1
        if sum(position) == before:
            raise ScheduleError(f"the schedule deadlocks at actions {position}")
    return max(free + link_free)


def peak_bytes_from_order(actions, chunk_bytes, w_bytes=None) -> int:
    """Peak of the activation bytes a stage holds when it runs ``actions`` in order: an F adds
    its chunk's bytes (``chunk_bytes[c]``), its B frees them — all but W's (input, output
    gradient) pairs (``w_bytes[c]``, zero bubble: ``weight_grad.py``), which its W frees."""
    split = any(a[0] == "W" for a in actions)
    live = peak = 0
    for a in actions:
        c = a[2] if len(a) > 2 else 0
        kept = w_bytes[c] if split else 0
        if a[0] == "F":
            live += chunk_bytes[c]
            peak = max(peak, live)
        elif a[0] == "B":
            live -= chunk_bytes[c] - kept
        elif a[0] == "W":
            live -= kept
    return peak


def _chunk_bytes(stage, batch, seq_len, d_model, targets) -> tuple:
    """Bytes autograd saves for one micro-batch through each of this stage's chunks alone;
    and of those, the bytes zero bubble's B leaves for W (its held pairs)."""
    out, kept, params = [], [], list(stage.parameters())
    device = params[0].device
    for c, chunk in enumerate(stage.chunks):
        def one(x, chunk=chunk):
            h = chunk(chunk.embed(x) if chunk.first else x)
            return chunk.loss(h, targets) if chunk.last else h

        x = (torch.zeros(batch, seq_len, dtype=torch.long, device=device) if chunk.first else
             torch.zeros(batch, seq_len, d_model, device=device, requires_grad=True))
        out.append(saved_activation_bytes(one, x, exclude=params))
        rest = [q for q in stage.chunk_parameters(c) if q not in stage.w_params[c]]
        with LiveSavedBytes(exclude=params) as live:
            with LinearCalls(stage.w_params[c]) as calls:
                h = one(x)
            grad = None if chunk.last else torch.ones_like(h)
            work = backward_input(h, grad, x, calls.calls, rest, not chunk.first)[1]
            kept.append(live.live)
            del work
    stage.zero_grad()
    return out, kept


def _rank_runs(kind, cases, m, batch, unit, config, repeats):
    from minitrain.model import GPT, GPTConfig

    p = dist.get_world_size()
    g = torch.Generator(device="cpu").manual_seed(1)  # data: CPU numbers, moved
    device = get_device()
    results = []
    for name, v in cases:
        zb = name == "zero_bubble"
        if kind == "sleep":
            # F sleeps ``unit``, a whole backward 2 units (the chapter's convention), a chunk's
            # too: the bubble fraction is the same as with chunks of 1/v (all costs scale
            # alike), and the per-message overhead stays small next to the sleep
            with torch.device(device):
                model = SleepGPT(p * v, unit, unit if zb else 2 * unit, unit if zb else 0.0)
            x, y = (torch.zeros(batch, 2, dtype=torch.long, device=device) for _ in range(2))
        else:
            torch.manual_seed(0)
            with torch.device(device):
                model = GPT(GPTConfig(**config))
            shape = (batch, config["seq_len"])
            x = torch.randint(0, config["vocab_size"], shape, generator=g, device="cpu").to(device)
            y = torch.randint(0, config["vocab_size"], shape, generator=g, device="cpu").to(device)
        stage = (SleepStage if kind == "sleep" else PipelineStage)(model, num_chunks=v)
        schedule = make_schedule(name, p, m, v)
        # warm-up: gloo connects a pair of ranks on its first message, and the first
        # activation over each link carries the shape header
        stage.train_step(x, y, schedule, m)
        runs = []
        for _ in range(repeats):
            stage.zero_grad()
            dist.barrier()
            trace.reset()
            with LiveSavedBytes(exclude=list(stage.parameters())) as live:
                t = device_clock(x.device)
                loss = stage.train_step(x, y, schedule, m)
                seconds = device_clock(x.device) - t
            runs.append(dict(events=trace.events(), seconds=seconds, peak_bytes=live.peak))
        chunk_bytes = w_bytes = None
        if kind == "gpt":
            chunk_bytes, w_bytes = _chunk_bytes(stage, batch // m, config["seq_len"],
                                                config["d_model"], y[: batch // m].clone())
        results.append(dict(runs=runs, loss=loss.item(), chunk_bytes=chunk_bytes,
                            w_bytes=w_bytes, schedule=schedule))
        dist.barrier()
    return results


def run_pipelines(kind: str, num_stages: int, num_microbatches: int, cases, batch=None,
                  unit: float = 0.02, config=None, repeats: int = 1, timeout: float = 120,
                  link=None) -> dict:
    """Run each ``(schedule name, num_chunks)`` of ``cases`` on ``num_stages`` ranks (one launch).

    ``kind`` is "sleep" (calibrated sleeps of ``unit`` seconds per action) or "gpt"
    (the course's GPT of ``config``). Each schedule runs ``repeats`` measured steps; the one
    with the median bubble is reported. Returns {(name, v): dict(events per rank, measured
    and predicted bubble, simulation, peak bytes per stage measured and predicted, step
    seconds, every repeat's ("step_seconds": the slowest rank's), loss)}. With ``link`` (a
    ``Link``) the ranks run on it, and per repeat each entry adds ``predicted_step`` from that
    repeat's action times without ("predicted_compute_only") and with α + n/β per activation
    or gradient ("predicted_seconds"; "message_seconds": that cost).
    """
    p, m, batch = num_stages, num_microbatches, batch or num_microbatches
    config = config or dict(vocab_size=64, seq_len=32, n_layer=2 * p, n_head=2, d_model=32)
    ranks = launch(_rank_runs, p, kind, list(cases), m, batch, unit, config, repeats,
                   timeout=timeout, link=link)
    out = {}
    for i, (name, v) in enumerate(cases):
        per_rank = [r[i] for r in ranks]
        schedule = per_rank[0]["schedule"]
        costs = UNIT if name == "zero_bubble" else WHOLE_BACKWARD
        sim = simulate(schedule, chunk_costs(v, costs), num_microbatches=m, num_chunks=v)
        runs = [[r["runs"][j]["events"] for r in per_rank] for j in range(repeats)]
        steps = [max(r["runs"][j]["seconds"] for r in per_rank) for j in range(repeats)]
        bubbles = [measured_bubble(events) for events in runs]
        k = bubbles.index(statistics.median_low(bubbles))
        entry = dict(
            events=runs[k], schedule=schedule, simulation=sim, measured_bubble=bubbles[k],
            bubbles=bubbles, predicted_bubble=float(sim.bubble_fraction), seconds=steps[k],
            step_seconds=steps, loss=per_rank[0]["loss"],
            peak_bytes=[max(run["peak_bytes"] for run in r["runs"]) for r in per_rank])
        if kind == "gpt":
            entry["chunk_bytes"] = [r["chunk_bytes"] for r in per_rank]
            entry["predicted_peak_bytes"] = [
                peak_bytes_from_order(schedule[s], per_rank[s]["chunk_bytes"], per_rank[s]["w_bytes"])
                for s in range(p)]
            entry["w_bytes"] = [r["w_bytes"] for r in per_rank]
        if link is not None:  # a message: (b/m, s, h) floats, or the sleep's (b/m, 2, 1)
            per_row = 2 if kind == "sleep" else config["seq_len"] * config["d_model"]
            cost = entry["message_seconds"] = p2p_time(4 * (batch // m) * per_row, link)
            for field, c in (("predicted_seconds", cost), ("predicted_compute_only", 0.0)):
                entry[field] = [predicted_step(schedule, action_seconds(evs), c, v) for evs in runs]
        out[(name, v)] = entry
    return out
