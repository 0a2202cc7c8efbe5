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
