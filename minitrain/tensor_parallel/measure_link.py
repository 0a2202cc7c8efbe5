"""Where tensor parallelism stops scaling: one block at t = 1 and t = 2, per width, on a link.

Used by notebooks/06_tensor_parallel.ipynb (section 12) and ``python -m minitrain.bench tp
--widths``. Notation as in measure.py: b batch, s sequence, h d_model, t tensor-parallel size,
e = 4 bytes per element (fp32).

A block's matmuls cost ~24·b·s·h² FLOP forward and twice that backward, split t ways by
tensor parallelism; its communication is 4 all-reduces of the b·s·h activation (2 forward,
2 backward; Shoeybi et al. 2019, §3), each 2(t−1)(α + b·s·h·e/(tβ)) on a ring. Compute falls
as h² and communication only as h, so below some width the all-reduces cost more than the
compute they save: TP then makes the block *slower*. ``crossover_width`` solves
4·all_reduce(h) = (1 − 1/t)·T₁(h) for h, with T₁(h) = k·h² fitted to the measured t = 1
times; ``measure_widths`` measures both sides on a modeled link (``minitrain.runtime.link``:
on a CPU the all-reduce is a memory copy by the cores that compute, and would hide the
lesson). On this 2-core machine t = 2 ranks each get a core; t = 4 would share them.
"""

from __future__ import annotations

import copy
import math
import time

import torch
import torch.distributed as dist

from minitrain.runtime import get_device, launch
from minitrain.runtime.link_costs import all_reduce_time

BYTES = 4  # fp32 activations


def block_communication_seconds(batch: int, seq_len: int, d_model: int, tp_size: int,
                                link) -> float:
    """One block's forward and backward all-reduces on ``link``: 4 of b·s·h elements."""
    return 4 * all_reduce_time(batch * seq_len * d_model * BYTES, tp_size, link)


def predicted_time(dense_seconds: float, batch: int, seq_len: int, d_model: int,
                   tp_size: int, link) -> float:
    """A block's forward + backward at t ranks: the measured t = 1 time split t ways (the
    replicated LayerNorms and residual adds neglected) plus its all-reduces."""
    return dense_seconds / tp_size + block_communication_seconds(batch, seq_len, d_model,
                                                                 tp_size, link)


def crossover_width(widths, dense_seconds, batch: int, seq_len: int, tp_size: int,
                    link) -> float:
    """The width h* at which t ranks' all-reduces cost what they save: solve
    4·2(t−1)(α + b·s·h·e/(tβ)) = (1 − 1/t)·k·h², k fitted by least squares to the measured
    t = 1 times T₁(h) ≈ k·h² (a quadratic in h; its positive root)."""
    k = sum(t * w**2 for w, t in zip(widths, dense_seconds)) / sum(w**4 for w in widths)
    ar_alpha = 4 * all_reduce_time(0, tp_size, link)  # the α part: 8(t−1)α
    ar_per_h = block_communication_seconds(batch, seq_len, 1, tp_size, link) - ar_alpha
    a = (1 - 1 / tp_size) * k
    return (ar_per_h + math.sqrt(ar_per_h**2 + 4 * a * ar_alpha)) / (2 * a)


def _rank_widths(widths, batch, seq_len, n_head, steps, link):
    """Per width: one block's forward + backward, dense on rank 0 alone and tensor-parallel
    on both ranks, taking turns step by step (a slow moment hits both), on ``link``."""
    from minitrain.model import GPT, GPTConfig
    from minitrain.runtime.link import use_link
    from minitrain.tensor_parallel import apply_tensor_parallel

    rank, device = dist.get_rank(), get_device()
    g = torch.Generator(device="cpu").manual_seed(1)  # CPU numbers, moved
    out = {}
    for h in widths:
        torch.manual_seed(0)
        config = GPTConfig(vocab_size=64, seq_len=seq_len, n_layer=1, n_head=n_head, d_model=h)
        with torch.device(device):  # built where this rank computes
            dense = GPT(config)
        blocks = {1: dense.blocks[0],
                  2: apply_tensor_parallel(copy.deepcopy(dense)).blocks[0]}
        x = torch.randn(batch, seq_len, h, generator=g, device="cpu").to(device)
        x.requires_grad_()
        times = {1: [], 2: []}
        for step in range(steps + 2):  # two warm-up steps
            for t, block in blocks.items():
                dist.barrier()  # (outside the link: not part of the step)
                if t == 1 and rank != 0:
                    continue  # one process: the other waits at the next barrier
                start = time.perf_counter()
                with use_link(link):
                    y = block(x)
                    y.backward(torch.ones_like(y))
                if step >= 2:
                    times[t].append(time.perf_counter() - start)
        out[h] = times
        del dense, blocks, x  # (the widest blocks are hundreds of MB)
    return out


def measure_widths(widths=(64, 256, 1024), batch: int = 1, seq_len: int = 32,
                   n_head: int = 4, steps: int = 4, link=None) -> dict:
    """One block's forward + backward at t = 1 and t = 2 for each width, on ``link``
    (default: ``LINKS["intra-node"]``, where tensor parallelism lives). Returns {"widths",
    "link", "dense", "tp" (the fastest step, s; t = 2: the slower rank's), "speedup"
    (dense / tp), "predicted" (``predicted_time``), "communication" (the 4 all-reduces),
    "crossover" (``crossover_width``)}."""
    from minitrain.runtime.link import LINKS

    link = link or LINKS["intra-node"]
    res = launch(_rank_widths, 2, list(widths), batch, seq_len, n_head, steps, link,
                 timeout=900)
    # the fastest step (timeit's rule): on a shared machine the others were slowed by it, and
    # t = 2 needs both cores at once, which a busy moment denies it more often than t = 1
    dense = [min(res[0][h][1]) for h in widths]
    tp = [min(map(max, zip(res[0][h][2], res[1][h][2]))) for h in widths]
    return {
        "widths": list(widths), "link": link, "batch": batch, "seq_len": seq_len,
        "dense": dense, "tp": tp, "speedup": [d / t for d, t in zip(dense, tp)],
        "predicted": [predicted_time(d, batch, seq_len, h, 2, link)
                      for d, h in zip(dense, widths)],
        "communication": [block_communication_seconds(batch, seq_len, h, 2, link)
                          for h in widths],
        "crossover": crossover_width(widths, dense, batch, seq_len, 2, link),
    }
