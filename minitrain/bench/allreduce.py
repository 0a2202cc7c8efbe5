"""Benchmark: bandwidth of our ring all-reduce against torch's ``dist.all_reduce``.

    python -m minitrain.bench allreduce [--quick] [--worlds 2 4]

Prints, for sizes 1 KB … 64 MB and world sizes 2 and 4 (gloo on this machine), the
median time, the algorithm bandwidth algbw = S / t and the bus bandwidth
busbw = algbw · 2(N-1)/N, as nccl-tests define them for all-reduce (its
doc/PERFORMANCE.md): busbw is what each link carried, comparable across N.
Then, side by side with torch's: the exercise ring, the pipelined ring
(``ring_all_reduce_pipelined``) and ``all_reduce(x, "auto")`` (the α–β model's pick) — each
the median of per-repetition time ratios to torch's (below 1: faster) and the largest
difference of its result from torch's.
Targets (chapter 4, issue 33): ring ≥ 0.7× torch's bandwidth at sizes ≥ 4 MB; auto ≤ 1.5×
torch's time at 1 MiB; the pipelined ring ≤ 1.15× at 64 MiB.
Used by notebooks/04_collectives_and_data_parallel.ipynb and docs/ch04_collectives_and_ddp.md.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from minitrain.bench import bench_parser
from minitrain.runtime import get_device, launch, slowest_rank_seconds

KB, MB = 1024, 1024 * 1024
SIZES = [KB * 4**i for i in range(9)]  # 1 KB, 4 KB, ..., 64 MB
QUICK_SIZES = [KB, 64 * KB, MB, 4 * MB, 16 * MB]


def _time_once(fn, x: torch.Tensor, group: ProcessGroup | None = None) -> float:
    """The slowest rank's time for one all-reduce of a copy of ``x`` (an op ends when its
    last rank does)."""
    y = x.clone()
    return slowest_rank_seconds(fn, y, group, device=y.device, group=group)[0]


def _torch_all_reduce(t, group: ProcessGroup | None = None):
    dist.all_reduce(t, group=group)


def _ring(t, group: ProcessGroup | None = None):
    from minitrain import collectives

    collectives.ring_all_reduce(t, group)  # looked up at call time: a learner's patch applies


def _pipelined(t, group: ProcessGroup | None = None):
    from minitrain import collectives

    collectives.ring_all_reduce_pipelined(t, group)


def _auto(t, group: ProcessGroup | None = None):
    from minitrain import collectives

    collectives.all_reduce(t, "auto", group)


PEERS = {"ring": _ring, "pipelined": _pipelined, "auto": _auto}  # each against torch's


def _max_difference(fn, x: torch.Tensor) -> float:
    """The largest |fn's sum - torch's sum| of a random tensor, over the ranks."""
    g = torch.Generator(device="cpu").manual_seed(dist.get_rank())
    y = torch.randn(x.shape, generator=g, device=x.device)
    ours, theirs = y.clone(), y.clone()
    fn(ours)
    dist.all_reduce(theirs)
    worst = (ours - theirs).abs().max().reshape(1) if y.numel() else torch.zeros(1, device=x.device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def _rank_peers(sizes, reps):
    """Per size: {name: (median ms, median per-repetition ratio to torch, max |difference|)},
    torch's first; every repetition times torch and each peer in turn."""
    out = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, device="cpu")
        fns = {"torch": _torch_all_reduce, **PEERS}
        for fn in fns.values():  # warm-up: connections, buffers, α and β of "auto"
            _time_once(fn, x)
        times = {name: [] for name in fns}
        for _ in range(reps):
            for name, fn in fns.items():
                times[name].append(_time_once(fn, x))
        row = {}
        for name, fn in fns.items():
            ratios = [a / b for a, b in zip(times[name], times["torch"])]
            diff = 0.0 if name == "torch" else _max_difference(fn, x)
            row[name] = (statistics.median(times[name]) * 1e3, statistics.median(ratios), diff)
        out.append((nbytes, row))
    return out


def run_peers(worlds=(2, 4), sizes=(MB, 64 * MB), reps=10) -> dict:
    """{world: [(bytes, {name: (median ms, ratio to torch, max diff)})]}, ``_rank_peers``."""
    return {w: launch(_rank_peers, w, list(sizes), reps, timeout=900)[0] for w in worlds}


def report_peers(results: dict) -> str:
    lines = ["\nside by side with torch's all-reduce (gloo): median ms, median of per-repetition "
             "ratios to torch, max |result - torch's|"]
    for world, rows in results.items():
        for nbytes, row in rows:
            cells = "  ".join(
                f"{name} {ms:8.2f}ms {ratio:5.2f}x diff {diff:.1e}"
                if name != "torch" else f"torch {ms:8.2f}ms"
                for name, (ms, ratio, diff) in row.items()
            )
            lines.append(f"world {world} {_fmt_size(nbytes):>6}: {cells}")
    return "\n".join(lines)


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
    parser.add_argument("--peers-only", action="store_true",
                        help="only the side-by-side table (1 MiB and 64 MiB)")
    args = parser.parse_args(argv)
    if not args.peers_only:
        if args.quick:
            results = run(args.worlds, QUICK_SIZES, reps_small=10, reps_large=4)
        else:
            results = run(args.worlds)
        print(report(results))
    print(report_peers(run_peers(args.worlds, reps=8 if args.quick else 12)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
