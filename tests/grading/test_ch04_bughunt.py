"""Chapter 4 bug hunt (minitrain.course.bughunts): gradient accumulation under DataParallel.

Four micro-batches on 2 ranks, the first three inside ``no_sync()``. Reference: one process
accumulating the same four global micro-batches (the average over ranks of per-rank means is
the global mean: equal shares). And the timeline: with accumulation, only the last backward
all-reduces — one all-reduce per bucket, not one per bucket per micro-batch.
"""

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn

from minitrain.runtime import launch

MICRO, WORLD, ROWS = 4, 2, 8


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def _batch(k):
    g = torch.Generator().manual_seed(k)
    return torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 1, generator=g)


def _accumulate_ddp():
    from minitrain.ddp import DataParallel
    from minitrain.runtime import trace

    rank = dist.get_rank()
    model = _model()
    ddp = DataParallel(model, bucket_cap_mb=0.0005)  # a few buckets
    trace.reset()
    for k in range(MICRO):
        x, y = _batch(k)
        rows = slice(rank * ROWS // WORLD, (rank + 1) * ROWS // WORLD)
        with ddp.no_sync() if k < MICRO - 1 else nullcontext():
            nn.functional.mse_loss(ddp(x[rows]), y[rows]).backward()
    reduces = sum(e.name.startswith("all-reduce bucket") for e in trace.events())
    return [p.grad.clone() for p in model.parameters()], reduces, len(ddp.buckets)


@pytest.mark.exercise("bug hunt: DataParallel.no_sync", points=2)
def test_accumulation_all_reduces_once_and_matches_one_process():
    model = _model()
    for k in range(MICRO):
        x, y = _batch(k)
        nn.functional.mse_loss(model(x), y).backward()
    want = [p.grad for p in model.parameters()]
    for rank, (grads, reduces, buckets) in enumerate(launch(_accumulate_ddp, WORLD, timeout=60)):
        err = max((g - w).abs().max().item() for g, w in zip(grads, want))
        assert err < 1e-5, (
            f"rank {rank}: accumulated gradients differ from one process by {err:.3g}"
        )
        assert reduces == buckets, (
            f"rank {rank}: accumulating {MICRO} micro-batches ran {reduces} bucket all-reduces; "
            f"with no_sync only the last backward should, once per bucket: {buckets} "
            f"({reduces // max(buckets, 1)}× the traffic)"
        )
