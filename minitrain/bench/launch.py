"""Benchmark: how long a 4-rank launch takes, minitrain.runtime vs torch.multiprocessing.spawn.

    python -m minitrain.bench launch [--world-size 4] [--repeats 10]

Both start the ranks, initialise a gloo process group, all-reduce one number and
tear down: the fixed cost a notebook cell pays before any real work. Target: a
warm minitrain launch (forkserver already running) ≤ 0.3 s on a 2-core machine.
"""

from __future__ import annotations

import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from minitrain.bench import bench_parser
from minitrain.runtime import get_device, launch


def _work():
    t = torch.ones(1, device=get_device())
    dist.all_reduce(t)
    return t.item()


def _spawn_entry(rank, world_size, port):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    _work()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_once(world_size: int) -> None:
    tmp.spawn(_spawn_entry, args=(world_size, _free_port()), nprocs=world_size, join=True)


def main(argv=None) -> int:
    parser = bench_parser("launch", __doc__)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--spawn-repeats", type=int, default=3, help="spawn is slow: fewer runs")
    args = parser.parse_args(argv)
    w = args.world_size

    t0 = time.perf_counter()
    launch(_work, w)
    first = time.perf_counter() - t0
    warm = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        launch(_work, w)
        warm.append(time.perf_counter() - t0)
    spawn = []
    for _ in range(args.spawn_repeats):
        t0 = time.perf_counter()
        spawn_once(w)
        spawn.append(time.perf_counter() - t0)

    ours, theirs = statistics.median(warm), statistics.median(spawn)
    print(f"{w}-rank launch, all-reduce of one number, gloo, {os.cpu_count()} cores")
    print(f"  minitrain.runtime first (starts the forkserver): {first:.3f} s")
    print(
        f"  minitrain.runtime warm, median of {len(warm)}:   {ours:.3f} s "
        f"(min {min(warm):.3f}, max {max(warm):.3f})"
    )
    print(f"  torch.multiprocessing.spawn, median of {len(spawn)}:  {theirs:.3f} s")
    print(
        f"  ratio minitrain warm / spawn: {ours / theirs:.3f}  (spawn is {theirs / ours:.0f}x slower)"
    )
    print(f"  target warm ≤ 0.3 s: {'met' if ours <= 0.3 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
