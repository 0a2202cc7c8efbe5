"""Measuring a pipeline: timelines, the bubble and activation memory, next to the formulas.

Chapter 7, notebooks/07_pipeline_parallel.ipynb (and its widget and ``python -m
minitrain.bench pipeline``). ``run_pipelines`` launches p ranks once and runs several
schedules on them, each traced with ``minitrain.runtime.trace``, returning per schedule the
timelines, the measured bubble, the predicted one (``check.simulate``), and the peak bytes
autograd held per stage (``minitrain.memory.LiveSavedBytes``) next to the in-flight formula.

Two kinds of stage:
- ``"gpt"``: the course's GPT, real compute. On this 2-core machine p ranks share two cores,
  so compute times depend on the load and the bubble only roughly follows the formula.
- ``"sleep"``: **a calibrated sleep**, not a model: ``SleepGPT`` has the GPT's parts but each
  block's forward, input-gradient and weight-gradient each sleep a fixed time (``unit``),
  so the timeline depends on the schedule alone and the bubble must match the formula.
  The sleep happens where the stage computes: on a GPU a kernel that spins (a host sleep
  would leave the device idle, and the device-timed trace would show no compute at all).

On a GPU the trace's spans are the device's (``trace``'s event clock, issue 41): host times
would show when work was queued, and NCCL's waits do not block the host.
"""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from minitrain.memory import LiveSavedBytes, saved_activation_bytes
from minitrain.pipeline.check import UNIT, chunk_costs, simulate
from minitrain.pipeline.executor import PipelineStage
from minitrain.pipeline.schedules import make_schedule
from minitrain.runtime import device_clock, get_device, launch, trace

_overshoot = []
_gpu_cycles_per_second: dict = {}


def calibrated_sleep(seconds: float, device="cpu") -> None:
    """Sleep ``seconds`` on ``device``. The host: ``time.sleep`` minus its measured overshoot
    on this machine (median of a few tries). A GPU: a kernel spinning that long
    (``torch.cuda._sleep``), queued on the current stream like the compute it stands for."""
    if seconds <= 0:
        return
    if torch.device(device).type == "cuda":
        torch.cuda._sleep(int(seconds * _cycles_per_second(device)))
        return
    if not _overshoot:
        tries = []
        for _ in range(5):
            t = time.perf_counter()
            time.sleep(0.002)
            tries.append(time.perf_counter() - t - 0.002)
        _overshoot.append(statistics.median(tries))
    time.sleep(max(0.0, seconds - _overshoot[0]))


def _cycles_per_second(device) -> float:
    """The GPU's spin-kernel cycles per second, timed once by two events around 20 ms of it."""
    device = torch.device(device)
    if device not in _gpu_cycles_per_second:
        with torch.cuda.device(device):
            torch.cuda._sleep(1_000_000)  # warm-up: the first launch pays its set-up
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            cycles = 20_000_000  # ~20 ms at 1 GHz
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            _gpu_cycles_per_second[device] = cycles / (start.elapsed_time(end) / 1e3)
    return _gpu_cycles_per_second[device]


class _Sleep(torch.autograd.Function):
    """Identity that sleeps ``forward_s`` in forward and ``backward_s`` in backward."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        calibrated_sleep(forward_s, x.device)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        calibrated_sleep(ctx.backward_s, grad.device)
        return grad, None, None


class SleepBlock(nn.Module):
    """out = sleep(x) + sleep(w): forward costs ``t_f``; the input gradient (B) ``t_b``, the
    weight gradient (W) ``t_w`` — autograd runs only the branch a backward asks for."""

    def __init__(self, t_f: float, t_b: float, t_w: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(()))
        self.t_f, self.t_b, self.t_w = t_f, t_b, t_w

    def forward(self, x):
        return _Sleep.apply(x, self.t_f, self.t_b) + _Sleep.apply(self.weight, 0.0, self.t_w)


class SleepGPT(nn.Module):
    """The GPT's parts (embed, blocks, logits) with calibrated-sleep blocks and no real work.
    One block per virtual stage, so each chunk's F, B and W cost exactly one sleep."""

    def __init__(self, n_layer: int, t_f: float, t_b: float, t_w: float = 0.0):
        super().__init__()
        self.config = SimpleNamespace(n_layer=n_layer, tie_weights=False)
        self.tok_emb, self.pos_emb = nn.Identity(), nn.Identity()
        self.blocks = nn.ModuleList(SleepBlock(t_f, t_b, t_w) for _ in range(n_layer))
        self.ln_f, self.head = nn.Identity(), nn.Identity()

    def embed(self, idx, positions=None):  # positions: the GPT's signature; nothing sits anywhere
        return idx.float().unsqueeze(-1)

    def logits(self, h):
        return torch.cat([h, -h], dim=-1)  # two "tokens": lm_loss runs as for the GPT


def measured_bubble(events_per_rank) -> float:
    """1 - (time every rank computed) / (ranks x span from the first compute to the last)."""
    compute = [[e for e in evs if e.kind == "compute"] for evs in events_per_rank]
    start = min(e.start for evs in compute for e in evs)
    end = max(e.end for evs in compute for e in evs)
    busy = sum(e.duration for evs in compute for e in evs)
    return 1.0 - busy / (len(compute) * (end - start))


def peak_bytes_from_order(actions, chunk_bytes) -> int:
    """Peak of the activation bytes a stage holds when it runs ``actions`` in order: an F adds
    its chunk's bytes (``chunk_bytes[c]``), the last of B/W of that micro-batch frees them."""
    frees = "W" if any(a[0] == "W" for a in actions) else "B"
    live = peak = 0
    for a in actions:
        c = a[2] if len(a) > 2 else 0
        if a[0] == "F":
            live += chunk_bytes[c]
            peak = max(peak, live)
        elif a[0] == frees:
            live -= chunk_bytes[c]
    return peak


def _chunk_bytes(stage, batch, seq_len, d_model, targets) -> list:
    """Bytes autograd saves for one micro-batch through each of this stage's chunks alone."""
    out = []
    params = list(stage.parameters())
    for chunk in stage.chunks:
        def one(x, chunk=chunk):
            h = chunk(chunk.embed(x) if chunk.first else x)
            return chunk.loss(h, targets) if chunk.last else h

        device = params[0].device
        if chunk.first:
            x = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
        else:
            x = torch.zeros(batch, seq_len, d_model, device=device, requires_grad=True)
        out.append(saved_activation_bytes(one, x, exclude=params))
    return out


def _rank_runs(kind, cases, m, batch, unit, config, repeats):
    from minitrain.model import GPT, GPTConfig

    p = dist.get_world_size()
    g = torch.Generator(device="cpu").manual_seed(1)  # data: CPU numbers, moved
    device = get_device()
    results = []
    for name, v in cases:
        zb = name == "zero_bubble"
        if kind == "sleep":
            # every action sleeps ``unit``, a chunk's too: the bubble fraction is the same
            # as with chunks of unit/v (all costs scale alike), and the per-message overhead
            # stays small next to the sleep
            with torch.device(device):
                model = SleepGPT(p * v, unit, unit, unit if zb else 0.0)
            x = torch.zeros(batch, 2, dtype=torch.long, device=device)
            y = torch.zeros(batch, 2, dtype=torch.long, device=device)
        else:
            torch.manual_seed(0)
            with torch.device(device):
                model = GPT(GPTConfig(**config))
            shape = (batch, config["seq_len"])
            x = torch.randint(0, config["vocab_size"], shape, generator=g, device="cpu").to(device)
            y = torch.randint(0, config["vocab_size"], shape, generator=g, device="cpu").to(device)
        stage = PipelineStage(model, num_chunks=v)
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
        chunk_bytes = None
        if kind == "gpt":
            chunk_bytes = _chunk_bytes(stage, batch // m, config["seq_len"], config["d_model"],
                                       y[: batch // m].clone())
        results.append(dict(runs=runs, loss=loss.item(), chunk_bytes=chunk_bytes,
                            schedule=schedule))
        dist.barrier()
    return results


def run_pipelines(kind: str, num_stages: int, num_microbatches: int, cases, batch=None,
                  unit: float = 0.02, config=None, repeats: int = 1, timeout: float = 120) -> dict:
    """Run each ``(schedule name, num_chunks)`` of ``cases`` on ``num_stages`` ranks (one launch).

    ``kind`` is "sleep" (calibrated sleeps of ``unit`` seconds per action) or "gpt"
    (the course's GPT of ``config``). Each schedule runs ``repeats`` measured steps; the one
    with the median bubble is reported. Returns {(name, v): dict(events per rank, measured
    and predicted bubble, simulation, peak bytes per stage measured and predicted, step
    seconds, loss)}.
    """
    p, m = num_stages, num_microbatches
    batch = batch or m
    config = config or dict(vocab_size=64, seq_len=32, n_layer=2 * p, n_head=2, d_model=32)
    ranks = launch(_rank_runs, p, kind, list(cases), m, batch, unit, config, repeats,
                   timeout=timeout)
    out = {}
    for i, (name, v) in enumerate(cases):
        per_rank = [r[i] for r in ranks]
        schedule = per_rank[0]["schedule"]
        costs = UNIT if name == "zero_bubble" else {"F": 1, "B": 1}
        sim = simulate(schedule, chunk_costs(v, costs), num_microbatches=m, num_chunks=v)
        bubbles = [measured_bubble([r["runs"][k]["events"] for r in per_rank])
                   for k in range(repeats)]
        k = bubbles.index(statistics.median_low(bubbles))
        entry = dict(
            events=[r["runs"][k]["events"] for r in per_rank], schedule=schedule,
            simulation=sim, measured_bubble=bubbles[k], bubbles=bubbles,
            predicted_bubble=float(sim.bubble_fraction),
            seconds=max(r["runs"][k]["seconds"] for r in per_rank), loss=per_rank[0]["loss"],
            peak_bytes=[max(run["peak_bytes"] for run in r["runs"]) for r in per_rank],
        )
        if kind == "gpt":
            entry["chunk_bytes"] = [r["chunk_bytes"] for r in per_rank]
            entry["predicted_peak_bytes"] = [
                peak_bytes_from_order(schedule[s], per_rank[s]["chunk_bytes"]) for s in range(p)]
        out[(name, v)] = entry
    return out
