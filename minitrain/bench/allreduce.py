"""Benchmark: bandwidth of our ring all-reduce against torch's ``dist.all_reduce``.

    python -m minitrain.bench allreduce [--quick] [--worlds 2 4]

Prints, for sizes 1 KB … 64 MB and world sizes 2 and 4 (gloo on this machine), the
median time, the algorithm bandwidth algbw = S / t and the bus bandwidth
busbw = algbw · 2(N-1)/N, as nccl-tests define them for all-reduce (its
doc/PERFORMANCE.md): busbw is what each link carried, comparable across N.
Target (chapter 4): ring ≥ 0.7× torch's bandwidth at sizes ≥ 4 MB.
Used by notebooks/04_collectives_and_data_parallel.ipynb and docs/ch04_collectives_and_ddp.md.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from minitrain.bench import bench_parser
from minitrain.runtime import device_clock, get_device, launch

KB, MB = 1024, 1024 * 1024
SIZES = [KB * 4**i for i in range(9)]  # 1 KB, 4 KB, ..., 64 MB
QUICK_SIZES = [KB, 64 * KB, MB, 4 * MB, 16 * MB]


def _time_once(fn, x: torch.Tensor, group: ProcessGroup | None = None) -> float:
    """The slowest rank's time for one all-reduce of a copy of ``x`` (an op ends when its
    last rank does)."""
    y = x.clone()
    dist.barrier(group)
    start = device_clock(y.device)
    fn(y, group)
    elapsed = torch.tensor(device_clock(y.device) - start, dtype=torch.float64, device=y.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return elapsed.item()


def _torch_all_reduce(t, group: ProcessGroup | None = None):
    dist.all_reduce(t, group=group)


def _ring(t, group: ProcessGroup | None = None):
    from minitrain import collectives

    collectives.ring_all_reduce(t, group)  # looked up at call time: a learner's patch applies


def _rank_bench(sizes, reps_small, reps_large):
    """Per size: median times of torch's and our all-reduce (fp32), measured alternately so
    that a busy moment of the machine hits both alike."""
    rows = []
    for nbytes in sizes:
        reps = reps_small if nbytes < MB else max(5, reps_large * 4 * MB // max(nbytes, 4 * MB))
        x = torch.ones(nbytes // 4, device=get_device())  # NCCL's all-reduce on a GPU
        _time_once(_torch_all_reduce, x), _time_once(_ring, x)  # warm-up: connections, buffers
        t_torch, t_ring = [], []
        for _ in range(reps):
            t_torch.append(_time_once(_torch_all_reduce, x))
            t_ring.append(_time_once(_ring, x))
        rows.append(
            (
                nbytes,
                statistics.median(t_torch),
                statistics.median(t_ring),
                min(t_torch),
                min(t_ring),
            )
        )
    return rows


def bandwidths(nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s for an all-reduce of ``nbytes`` taking ``seconds`` on ``world`` ranks."""
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * 2 * (world - 1) / world


def run(worlds=(2, 4), sizes=SIZES, reps_small=30, reps_large=10) -> dict[int, list[tuple]]:
    """Measure; returns {world: [(bytes, median t_torch, median t_ring, best t_torch,
    best t_ring), ...]}."""
    return {
        w: launch(_rank_bench, w, sizes, reps_small, reps_large, timeout=600)[0] for w in worlds
    }


def _fmt_size(n: int) -> str:
    return f"{n // MB} MB" if n >= MB else f"{n // KB} KB"


def report(results: dict[int, list[tuple]]) -> str:
    lines = []
    for world, rows in results.items():
        lines.append(f"\nworld {world} (gloo): algbw / busbw in GB/s, medians")
        lines.append(
            f"{'size':>7} | {'torch time':>10} {'algbw':>6} {'busbw':>6} | "
            f"{'ring time':>10} {'algbw':>6} {'busbw':>6} | ring/torch bw (best-of)"
        )
        for nbytes, t_torch, t_ring, best_torch, best_ring in rows:
            a_t, b_t = bandwidths(nbytes, t_torch, world)
            a_r, b_r = bandwidths(nbytes, t_ring, world)
            lines.append(
                f"{_fmt_size(nbytes):>7} | {t_torch * 1e3:8.3f}ms {a_t:6.3f} {b_t:6.3f} | "
                f"{t_ring * 1e3:8.3f}ms {a_r:6.3f} {b_r:6.3f} | {t_torch / t_ring:5.2f}x "
                f"({best_torch / best_ring:4.2f}x)"
            )
        big = [row[1] / row[2] for row in rows if row[0] >= 4 * MB]
        if big:
            verdict = "met" if min(big) >= 0.7 else "NOT met"
            lines.append(
                f"target ring >= 0.7x torch at >= 4 MB: {verdict} "
                f"(worst {min(big):.2f}x, median {statistics.median(big):.2f}x)"
            )
    lines.append(
        "\n(best-of: ratio of the fastest repetitions. On a loaded machine gloo's point-to-point "
        "messages\nsometimes wait milliseconds for a thread wake-up; the ring, with 2(N-1) "
        "dependent steps,\nsuffers more from that than torch's all-reduce.)"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = bench_parser("allreduce", __doc__, quick="fewer sizes and repetitions")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args(argv)
    if args.quick:
        results = run(args.worlds, QUICK_SIZES, reps_small=10, reps_large=4)
    else:
        results = run(args.worlds)
    print(report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
