"""The α–β cost model of communication, fitted to this machine and checked against it.

Used by notebooks/04_collectives_and_data_parallel.ipynb. Sending a message of m bytes
costs T(m) = α + β·m: a fixed latency α (software, the network stack) plus m over the
bandwidth 1/β (Hockney 1994, "The communication challenge for MPP"; used for every
collective by Thakur, Rabenseifner & Gropp 2005). Counting messages per algorithm, for
an all-reduce of n bytes on N ranks:

* ring:                2(N-1) steps of n/N bytes   → 2(N-1)·α + 2(N-1)/N · n·β
* naive (root):        N-1 receives + N-1 sends of n → 2(N-1)·α + 2(N-1) · n·β
* recursive doubling:  log2 N swaps of n bytes     → log2(N)·α + log2(N) · n·β
  (N a power of two)

So for large n the ring wins by a factor N over naive; for tiny n the latency terms
decide and recursive doubling's log2 N beats the ring's 2(N-1). The time spent adding
(a γ·bytes term) is left out: on this machine adding is ~10× faster than sending.

α and β are fitted (least squares) to one ring *step* — every rank sends m bytes to
its successor while receiving from its predecessor — measured with the same ranks, so
the contention of N processes on few cores is part of the fit. The notebook measures on a
modeled link (``minitrain.runtime.link``, issue 42), whose α and β the fit must recover:
timings there run from the last rank's start (``seconds_of``) and take the median.

Section 6's DDP on that link: ``link_for_overlap`` sizes a link to a measured backward (one
all-reduce of the gradients as long as backward), ``modeled_step`` predicts a step's time
per bucket size — bucket count × α against the communication left after backward.
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.distributed as dist

from minitrain.runtime import device_clock, get_device, slowest_rank_seconds


def fit_alpha_beta(nbytes: list[int], seconds: list[float]) -> tuple[float, float]:
    """Fit seconds = α + β·bytes; returns (α in s, β in s/byte).

    Least squares on *relative* errors (weights 1/t²): the times span several orders of
    magnitude, and a plain fit would let the largest message decide α as well as β.
    """
    if len(nbytes) != len(seconds) or len(nbytes) < 2:
        raise ValueError(
            f"fit_alpha_beta: need ≥ 2 (bytes, seconds) pairs of equal length, "
            f"got {len(nbytes)} and {len(seconds)}"
        )
    if len(set(nbytes)) < 2:
        raise ValueError(f"fit_alpha_beta: the sizes must not all be equal, got {nbytes}")
    if min(seconds) <= 0:
        raise ValueError(f"fit_alpha_beta: times must be positive, got {seconds}")
    w = [1.0 / t**2 for t in seconds]
    # normal equations of min Σ w (α + β x - t)²
    s0, s1 = sum(w), sum(wi * x for wi, x in zip(w, nbytes))
    s2 = sum(wi * x * x for wi, x in zip(w, nbytes))
    t0 = sum(wi * t for wi, t in zip(w, seconds))
    t1 = sum(wi * x * t for wi, x, t in zip(w, nbytes, seconds))
    det = s0 * s2 - s1 * s1
    return (s2 * t0 - s1 * t1) / det, (s0 * t1 - s1 * t0) / det


def predict_all_reduce(
    algorithm: str, nbytes: float, world_size: int, alpha: float, beta: float
) -> float:
    """Seconds the α–β model predicts for one all-reduce of ``nbytes`` (formulas above)."""
    N = world_size
    if N == 1:
        return 0.0
    if algorithm == "ring":
        return 2 * (N - 1) * (alpha + nbytes / N * beta)
    if algorithm == "naive":
        return 2 * (N - 1) * (alpha + nbytes * beta)
    if algorithm == "recursive_doubling":
        power = 1 << (N.bit_length() - 1)
        steps = int(math.log2(power)) + (2 if power != N else 0)  # fold in and out
        return steps * (alpha + nbytes * beta)
    raise ValueError(f"predict_all_reduce: unknown algorithm {algorithm!r}")


def seconds_of(fn, device="cpu", group=None) -> float:
    """One timing of ``fn()`` on every rank of ``group`` (a collective), the same number on
    every rank. Without a modeled link: the slowest rank's time from a barrier
    (``slowest_rank_seconds``). On a modeled link (``minitrain.runtime.link``, one machine, so
    one clock): from the *last* rank's start to the last rank's end — a barrier lets ranks go
    a millisecond apart on a loaded machine, and a collective cannot start before its last
    rank calls it, so the earlier ranks' wait is the machine's, not the link's α."""
    from minitrain.runtime.link import link_of

    if link_of(group) is None:
        return slowest_rank_seconds(fn, device=device, group=group)[0]
    dist.barrier(group=group)
    start = device_clock(device)
    fn()
    ends = torch.tensor([start, device_clock(device)], dtype=torch.float64, device=device)
    dist.all_reduce(ends, op=dist.ReduceOp.MAX, group=group)  # (after the clock: untimed)
    return (ends[1] - ends[0]).item()


def typical_seconds(fn, reps: int, device="cpu", group=None) -> float:
    """Of ``reps`` timings of ``fn()`` (``seconds_of``) after one warm-up: the best without a
    modeled link, the median on one. Every rank of ``group`` calls it and gets the same number.

    The best without a link: the model describes the link, and on a machine shared with
    other programs a message sometimes waits milliseconds for its thread to be scheduled —
    errors that only ever add. On a modeled link a repetition can also end a little early (the
    link forgives a rank the time it woke late from its last wait), so the errors go both ways
    and the median is the estimate. On a GPU the clock is read once ``device``'s work is done."""
    from minitrain.runtime.link import link_of

    fn()
    times = [seconds_of(fn, device, group) for _ in range(reps)]
    return min(times) if link_of(group) is None else statistics.median(times)


def measure_ring_step(sizes: list[int], reps: int = 10) -> list[float]:
    """Run on every rank: best seconds for one ring step (send m bytes on, receive m) per size."""
    from minitrain.collectives import exchange
    from minitrain.runtime.point_to_point import ring_neighbours

    prev_rank, next_rank = ring_neighbours()
    out = []
    for m in sizes:
        device = get_device()
        send, recv = torch.ones(m // 4, device=device), torch.empty(m // 4, device=device)
        out.append(typical_seconds(lambda s=send, r=recv: exchange(s, next_rank, r, prev_rank), reps,
                              device))
    return out


def measure_all_reduce(algorithms: list[str], sizes: list[int], reps: int = 5) -> dict:
    """Run on every rank: {algorithm: [best seconds per size]} for fp32 tensors of ``sizes`` bytes."""
    from minitrain import collectives

    out = {}
    for algo in algorithms:
        out[algo] = []
        for n in sizes:
            x = torch.ones(n // 4, device=get_device())
            out[algo].append(typical_seconds(lambda x=x, a=algo: collectives.all_reduce(x, a), reps,
                                        x.device))
    return out


# ------------------------------------------- data parallelism on a modeled link (section 6)
ALPHA_SHARE = 0.01  # link_for_overlap's α / backward (why: notebook 04, section 6)


def link_for_overlap(backward: float, gradient_bytes: int, world: int = 2,
                     alpha_share: float = ALPHA_SHARE, name: str = "comm = backward"):
    """The modeled link on which one all-reduce of all ``gradient_bytes`` takes as long as
    ``backward`` seconds (ring: 2(N-1)α + 2(N-1)/N·n/β), α being ``alpha_share`` of it: the
    regime where overlapping decides the step time (notebook 04, section 6)."""
    from minitrain.runtime.link import Link

    alpha = alpha_share * backward
    steps = 2 * (world - 1)
    bandwidth = steps / world * gradient_bytes / (backward - steps * alpha)
    return Link(alpha, bandwidth, name, f"all-reduce of {gradient_bytes / 2**20:.2f} MiB = "
                f"backward's {backward * 1e3:.1f} ms, α = {alpha_share:.0%} of it")


def modeled_step(bucket_bytes: list[int], backward: float, other: float, link, world: int = 2,
                 overlap: bool = True) -> float:
    """The step time the α–β model predicts (seconds): buckets ready as backward produces their
    bytes (evenly in time, in bucket order), each all-reduce queued behind the one before on
    the link (``link_costs.all_reduce_time``); the step ends when backward and the last
    all-reduce have, plus ``other`` (forward, optimizer). ``overlap=False``: every bucket
    launched after backward. Few buckets: the last one starts late; many: α per bucket."""
    from minitrain.runtime.link_costs import all_reduce_time

    total, done, free = sum(bucket_bytes), 0, 0.0
    for n in bucket_bytes:
        done += n
        ready = backward * done / total if overlap else backward
        free = max(ready, free) + all_reduce_time(n, world, link)
    return other + max(backward, free)
