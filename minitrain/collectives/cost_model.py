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
the contention of N processes on few cores is part of the fit.
"""

from __future__ import annotations

import math

import torch

from minitrain.runtime import get_device, slowest_rank_seconds


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


def _best_time(fn, reps: int, device) -> float:
    """Best of ``reps`` runs of the slowest rank's time for ``fn()``, after one warm-up.

    The best, not the median: the model describes the link, and on a machine shared with
    other programs a message sometimes waits milliseconds for its thread to be scheduled.
    On a GPU the clock is read once ``device``'s queued work is done."""
    fn()
    return min(slowest_rank_seconds(fn, device=device)[0] for _ in range(reps))


def measure_ring_step(sizes: list[int], reps: int = 10) -> list[float]:
    """Run on every rank: best seconds for one ring step (send m bytes on, receive m) per size."""
    from minitrain.collectives import exchange
    from minitrain.runtime.point_to_point import ring_neighbours

    prev_rank, next_rank = ring_neighbours()
    out = []
    for m in sizes:
        device = get_device()
        send, recv = torch.ones(m // 4, device=device), torch.empty(m // 4, device=device)
        out.append(_best_time(lambda s=send, r=recv: exchange(s, next_rank, r, prev_rank), reps,
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
            out[algo].append(_best_time(lambda x=x, a=algo: collectives.all_reduce(x, a), reps,
                                        x.device))
    return out
