"""Hello, ranks: the smallest distributed program, runnable three ways unchanged.

Used by notebook 00_getting_started and the README's "running on GPUs" section.

    python -m minitrain.runtime.hello --world-size 4                       # minitrain.runtime, this machine
    torchrun --standalone --nproc-per-node=4 -m minitrain.runtime.hello    # torchrun, one node
    # two nodes (here both on 127.0.0.1; on a cluster use the first node's address):
    torchrun --nnodes=2 --nproc-per-node=2 --node-rank=0 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=hello -m minitrain.runtime.hello
    torchrun --nnodes=2 --nproc-per-node=2 --node-rank=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=hello -m minitrain.runtime.hello

Each rank all-reduces its rank number; every rank must see 0 + 1 + … + (N-1).
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist

from minitrain.runtime import get_device, run, running_under_torchrun


def hello() -> dict:
    """One rank's greeting: who it is, where it runs, and the all-reduced sum of ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank)], device=get_device())
    dist.all_reduce(total)
    expected = world * (world - 1) / 2
    return {
        "rank": rank,
        "world_size": world,
        "host": socket.gethostname(),
        "local_rank": int(os.environ.get("LOCAL_RANK", rank)),
        "backend": dist.get_backend(),
        "sum_of_ranks": total.item(),
        "correct": total.item() == expected,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minitrain.runtime.hello",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--world-size", type=int, default=4, help="ranks (ignored under torchrun)")
    args = parser.parse_args(argv)
    results = run(hello, args.world_size)
    mine = [results] if running_under_torchrun() else results
    for r in mine:
        print(
            f"rank {r['rank']}/{r['world_size']} on {r['host']} (local rank {r['local_rank']}, "
            f"{r['backend']}): sum of ranks = {r['sum_of_ranks']:g} "
            f"{'✓' if r['correct'] else '✗ WRONG'}",
            flush=True,
        )
    return 0 if all(r["correct"] for r in mine) else 1


if __name__ == "__main__":
    raise SystemExit(main())
