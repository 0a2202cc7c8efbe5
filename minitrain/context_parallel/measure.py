"""Counting chapter 10: bytes, FLOPs, time and memory per rank, against the formulas.

Used by notebooks/10_context_parallel.ipynb, its widget (minitrain.widgets.
ch10_context_parallel) and ``python -m minitrain.bench context_parallel``. Notation: N the
sequence, P the context-parallel size, n = N/P tokens per rank, c the chunk length (n for
contiguous, n/2 for zigzag), bh = batch × heads, d the head size, e bytes per element.

- Bytes (Liu et al. 2023, section 3): a K or V block is bh·n·d·e bytes; forward sends K
  and V P−1 times, backward K and V P−1 times and dK, dV P times (the last hop home).
- Work: ``schedule`` lists, per rank and ring step, the (query chunk, key chunk) pairs
  computed (causal: pairs with the key chunk in the future are skipped, the diagonal is
  masked). Forward FLOPs of a pair are 4·bh·c²·d (q kᵀ and P v, 2 FLOPs per multiply-add);
  on the diagonal chapter 9's kernel skips the tiles wholly in the future, the rest it
  computes in full (``pair_entries``). Contiguous causal: rank r computes r + 1 pairs,
  so the last rank does P times the first's work; zigzag: every rank computes 2P pairs of
  half-size chunks (each c = n/2), the same for all (Brandon et al. 2023 make the same case).
- Overlap (``measure_overlap``): on a modeled link whose bandwidth W puts e·F/(2W) at a chosen
  n, the time a rank waits for K, V below and above it, next to max(0, transfer − compute).
- Memory: ring attention saves q, k, v, out (4·bh·n·d·e) and the logsumexp (bh·n·4) per
  rank — linear in N/P — and holds one score block of bh·c² at a time; full attention
  saves the bh·N² probabilities.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from minitrain.context_parallel.layout import check_divisible, num_chunks, rank_chunks
from minitrain.context_parallel.ring import (
    causal_blocks,
    communication_log,
    reset_communication_log,
    ring_attention,
)
from minitrain.flash_attention import flash_attention_forward
from minitrain.flash_attention.tiles import BLOCK_K, BLOCK_Q, blocks
from minitrain.runtime import device_clock, get_device, launch, trace


def ring_bytes(batch_heads, seq_len, head_dim, world_size, bytes_per_element=4) -> dict:
    """Bytes one rank sends per forward and per backward of ring attention (the formula)."""
    P = world_size
    block = batch_heads * (seq_len // P) * head_dim * bytes_per_element
    if P == 1:
        return {"forward": 0, "backward": 0}
    return {"forward": (P - 1) * 2 * block, "backward": (P - 1) * 2 * block + P * 2 * block}


def schedule(seq_len, world_size, layout="contiguous", causal=True) -> list[list[list[tuple]]]:
    """``[rank][step]``: the (query chunk, key chunk, diagonal) pairs computed there."""
    check_divisible(seq_len, world_size, layout)
    P, out = world_size, []
    for rank in range(P):
        q_chunks, steps = rank_chunks(rank, P, layout), []
        for step in range(P):
            kv_chunks = rank_chunks((rank - step) % P, P, layout)
            steps.append([(q_chunks[i], kv_chunks[j], diag)
                          for i, j, diag in causal_blocks(q_chunks, kv_chunks, causal)])
        out.append(steps)
    return out


def pair_entries(chunk, diagonal) -> int:
    """Scores chapter 9's tiled forward computes for one (query chunk, key chunk) pair:
    all chunk² of them, or on the diagonal only its tiles not wholly in the future."""
    if not diagonal:
        return chunk * chunk
    return sum((i1 - i0) * (j1 - j0) for i0, i1 in blocks(chunk, BLOCK_Q)
               for j0, j1 in blocks(chunk, BLOCK_K) if j0 <= i1 - 1)


def forward_flops(seq_len, world_size, layout="contiguous", causal=True, batch_heads=1,
                  head_dim=64) -> list[int]:
    """Forward attention FLOPs per rank: 4·bh·d per score computed (q kᵀ and P v)."""
    c = seq_len // num_chunks(world_size, layout)
    return [4 * batch_heads * head_dim * sum(pair_entries(c, diag) for s in steps for _, _, diag in s)
            for steps in schedule(seq_len, world_size, layout, causal)]


def saved_bytes_formula(batch_heads, seq_len, head_dim, world_size, bytes_per_element=4) -> int:
    """What one rank's ring attention saves for backward: q, k, v, out and the fp32 lse."""
    n = seq_len // world_size
    return 4 * batch_heads * n * head_dim * bytes_per_element + batch_heads * n * 4


def _rank_measure(batch, heads, seq_len, head_dim, layout, causal, repeats):
    from torch.utils.flop_counter import FlopCounterMode

    from minitrain.context_parallel.layout import shard_sequence
    from minitrain.memory import saved_activation_bytes

    g = torch.Generator(device="cpu").manual_seed(0)  # CPU numbers, moved to the rank's device
    q, k, v, grad = (torch.randn(batch, heads, seq_len, head_dim, generator=g, device="cpu")
                     .to(get_device()) for _ in range(4))
    shards = [shard_sequence(t, layout=layout) for t in (q, k, v, grad)]
    q, k, v = (t.requires_grad_() for t in shards[:3])
    counter = FlopCounterMode(display=False)
    with counter:
        out = ring_attention(q, k, v, causal=causal, layout=layout)
    flops_forward = counter.get_total_flops()
    reset_communication_log()
    out = ring_attention(q, k, v, causal=causal, layout=layout)
    sent_forward = sum(b for _, b in communication_log())
    reset_communication_log()
    out.backward(shards[3])
    sent_backward = sum(b for _, b in communication_log())
    saved = saved_activation_bytes(ring_attention, q, k, v, causal=causal, layout=layout)
    cpu, wall = [], []
    for _ in range(repeats):  # CPU seconds: robust to other processes sharing the cores
        dist.barrier()
        trace.reset()
        c0, w0 = time.process_time(), device_clock(q.device)
        ring_attention(q, k, v, causal=causal, layout=layout).backward(shards[3])
        wall.append(device_clock(q.device) - w0)
        cpu.append(time.process_time() - c0)
    return {"flops_forward": flops_forward, "sent_forward": sent_forward,
            "sent_backward": sent_backward, "saved_bytes": saved,
            "cpu_seconds": statistics.median(cpu), "wall_seconds": statistics.median(wall)}


def measure_ring(batch=1, heads=2, seq_len=256, head_dim=32, world_size=2, layout="contiguous",
                 causal=True, repeats=3, timeout=120) -> dict:
    """Run ring attention forward and backward on ``world_size`` ranks and measure it.

    Returns per-rank lists ("flops_forward", "sent_forward", "sent_backward", "saved_bytes",
    "cpu_seconds" — median over ``repeats`` of forward + backward — "wall_seconds"), the
    formulas next to them ("formula_*"), and "traces" (the last repeat's timeline).
    """
    results = launch(_rank_measure, world_size, batch, heads, seq_len, head_dim, layout,
                     causal, repeats, timeout=timeout)
    out = {key: [r[key] for r in results] for key in results[0]}
    bh = batch * heads
    formula = ring_bytes(bh, seq_len, head_dim, world_size)
    out["formula_sent_forward"], out["formula_sent_backward"] = formula["forward"], formula["backward"]
    out["formula_flops_forward"] = forward_flops(seq_len, world_size, layout, causal, bh, head_dim)
    out["formula_saved_bytes"] = saved_bytes_formula(bh, seq_len, head_dim, world_size)
    out["traces"] = results.traces
    return out


def work_per_step(seq_len, world_size, layout="contiguous", causal=True, batch_heads=2,
                  head_dim=32, repeats=3) -> dict:
    """Each rank's forward work at each ring step, measured in this one process.

    Runs the real ``ring_step`` (with ``send=False``: no communication) for every rank and
    step on the block that rank holds then, counting FLOPs with torch's FlopCounterMode and
    CPU seconds (median of ``repeats``). Returns {"flops": [rank][step], "seconds":
    [rank][step]} — what a rank computes, without the process group (for the widget).
    """
    from torch.utils.flop_counter import FlopCounterMode

    from minitrain.context_parallel.ring import ring_step

    check_divisible(seq_len, world_size, layout)
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(batch_heads, seq_len, head_dim, generator=g, device="cpu")
               .to(get_device()) for _ in range(3))
    chunks = [t.chunk(num_chunks(world_size, layout), dim=-2) for t in (q, k, v)]

    def shard(t, rank):
        return torch.cat([t[i] for i in rank_chunks(rank, world_size, layout)], dim=-2)

    flops = [[0] * world_size for _ in range(world_size)]
    seconds = [[0.0] * world_size for _ in range(world_size)]
    for rank in range(world_size):
        q_chunks = rank_chunks(rank, world_size, layout)
        qs = list(shard(chunks[0], rank).chunk(len(q_chunks), dim=-2))
        for step in range(world_size):
            src = (rank - step) % world_size
            kv = torch.stack([shard(chunks[1], src), shard(chunks[2], src)])
            kv_chunks = rank_chunks(src, world_size, layout)
            times = []
            for _ in range(repeats):
                outs, lses = [None] * len(qs), [None] * len(qs)
                counter = FlopCounterMode(display=False)
                start = time.process_time()
                with counter:
                    ring_step(qs, q_chunks, kv, kv_chunks, outs, lses, causal, send=False)
                times.append(time.process_time() - start)
            flops[rank][step] = counter.get_total_flops()
            seconds[rank][step] = statistics.median(times)
    return {"flops": flops, "seconds": seconds}


def overlap_summary(events) -> dict:
    """From one rank's trace: seconds of compute, of send/recv in flight, of waiting, and
    how much of the in-flight communication ran while the rank was computing."""
    compute = [e for e in events if e.kind == "compute"]
    comm = [e for e in events if e.kind == "communication"]
    waiting = [e for e in events if e.kind == "idle"]
    in_flight = sum(e.duration for e in comm)
    return {"compute": sum(e.duration for e in compute), "in_flight": in_flight,
            "waiting": sum(e.duration for e in waiting),
            "overlapped": trace.overlap_seconds(compute, comm)}


# ------------------------------------------------ the overlap threshold on a modeled link
def overlap_threshold(flops_per_second, bandwidth, bytes_per_element=4) -> float:
    """n ≥ e·F/(2W): the tokens per rank at which a block's compute, 4·n²·d FLOPs per head
    (non-causal), takes as long as its K, V transfer, 2·n·d·e bytes per head (notebook 10, §7)."""
    return bytes_per_element * flops_per_second / (2 * bandwidth)


def _block_spans(events):
    """(seconds of the first block computed, seconds blocked waiting for K, V) of one forward."""
    compute = [e.duration for e in events if e.kind == "compute"]
    waited = sum(e.duration for e in events if e.kind == "idle" and "K,V" in e.name)
    return compute[0], waited


def _forwards(q, k, v, repeats):
    spans = []
    for _ in range(repeats + 1):  # the first: warm-up (gloo connects on its first message)
        dist.barrier()
        trace.reset()
        ring_attention(q, k, v, causal=False)
        spans.append(_block_spans(trace.events()))
    return spans[1:]


def _cpu_seconds(fn, *args) -> float:
    start = time.process_time()
    fn(*args)
    return time.process_time() - start


def _rank_overlap(sizes, threshold, batch_heads, head_dim, repeats):
    from minitrain.runtime.link import Link, use_link

    g = torch.Generator(device="cpu").manual_seed(dist.get_rank())

    def shards(n):
        return [torch.randn(1, batch_heads, n, head_dim, generator=g, device="cpu")
                .to(get_device()) for _ in range(3)]

    with torch.no_grad():
        # this machine's attention rate on the block at the threshold: CPU seconds (what other
        # processes sharing the cores do not inflate), the best of three
        t = min(_cpu_seconds(flash_attention_forward, *shards(threshold)) for _ in range(3))
        rate = torch.tensor([4 * threshold**2 * head_dim * batch_heads / t], device=get_device())
        dist.all_reduce(rate)  # every rank builds the same link
        flops = rate.item() / dist.get_world_size()
        # the link's β puts e·F/(2W) at ``threshold``; α small next to a block (the formula
        # leaves α out)
        link = Link(t / 50, 4 * flops / (2 * threshold), "cp-threshold",
                    f"β chosen so that e·F/(2W) = {threshold} tokens at this machine's "
                    f"{flops / 1e9:.1f} GFLOP/s of attention")
        out = {}
        for n in sizes:
            data = shards(n)
            unmodeled = _forwards(*data, 1)[0][1]
            with use_link(link):  # the repeat that computed fastest: the least disturbed by
                compute, waited = min(_forwards(*data, repeats))  # other processes
            out[n] = {"compute": compute, "exposed": waited, "unmodeled": unmodeled}
    return {"flops": flops, "link": link, "sizes": out}


def measure_overlap(sizes=(64, 128, 1536, 2048), threshold=512, batch_heads=8, head_dim=64,
                    world_size=2, repeats=3, timeout=300) -> dict:
    """Ring attention's forward (non-causal, fp32) on ``world_size`` ranks over a modeled link
    whose bandwidth puts the overlap threshold e·F/(2W) at ``threshold`` tokens per rank, F this
    machine's attention rate measured at that size first (CPU time, best of three). Per size n (tokens per rank):
    the K, V transfer's modeled time α + n/β ("transfer"), the first block's compute (the one
    the transfer overlaps), the time blocked waiting for K, V ("exposed", from the trace; of the
    repeat whose block computed fastest, mean over ranks; "unmodeled": one run without the
    link), the prediction max(0, transfer − compute), and "hidden": exposed below a third of
    the transfer. Returns those per size ("sizes"), "link", "flops", "threshold"."""
    from minitrain.runtime.link_costs import p2p_time

    ranks = launch(_rank_overlap, world_size, list(sizes), threshold, batch_heads, head_dim,
                   repeats, timeout=timeout)
    link, rows = ranks[0]["link"], {}
    for n in sizes:
        transfer = p2p_time(2 * batch_heads * n * head_dim * 4, link)  # K and V, one block
        compute = statistics.mean(r["sizes"][n]["compute"] for r in ranks)
        exposed = statistics.mean(r["sizes"][n]["exposed"] for r in ranks)
        unmodeled = statistics.mean(r["sizes"][n]["unmodeled"] for r in ranks)
        rows[n] = {"transfer": transfer, "compute": compute, "exposed": exposed,
                   "unmodeled": unmodeled,
                   "predicted_exposed": max(0.0, transfer - compute),
                   "hidden": exposed < transfer / 3}
    return {"link": link, "flops": ranks[0]["flops"], "sizes": rows,
            "threshold": overlap_threshold(ranks[0]["flops"], link.bandwidth)}
