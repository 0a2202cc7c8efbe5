"""Graded tests of chapter 4 for what the docstrings state beyond the sums (issue 44): the ring
collectives work on a sub-group (its ranks, chunks and neighbours), and with overlap off the
gradient hook launches nothing during backward."""

import pytest
import torch
import torch.distributed as dist
from test_ch04_collectives_and_ddp import _train  # pytest puts this folder on sys.path

from minitrain.runtime import launch


def _ring_in_a_group(which):
    """The ring collective on the group of global ranks 0 and 2 of 3: chunks and neighbours
    are the group's; rank 1 takes no part."""
    from minitrain import collectives

    group = dist.new_group([0, 2])  # every rank takes part in creating it
    rank = dist.get_rank()
    result = None
    if rank in (0, 2):
        me = dist.get_rank(group)
        if which == "ring_reduce_scatter":
            x = torch.arange(6, dtype=torch.float32) * (rank + 1)  # summed: 4 x arange(6)
            out = torch.empty(3)
            collectives.ring_reduce_scatter(out, x, group)
            result = (out.tolist(), (torch.arange(6.0) * 4).tensor_split(2)[me].tolist())
        elif which == "ring_all_gather":
            out = torch.empty(6)
            collectives.ring_all_gather(out, torch.full((3,), float(rank)), group)
            result = (out.tolist(), [0.0] * 3 + [2.0] * 3)
        else:
            x = torch.arange(5, dtype=torch.float32) * (rank + 1)
            collectives.ring_all_reduce(x, group)
            result = (x.tolist(), (torch.arange(5.0) * 4).tolist())
    dist.barrier()
    return result


@pytest.mark.parametrize("which", [
    pytest.param(name, marks=pytest.mark.exercise(name, points=1))
    for name in ("ring_reduce_scatter", "ring_all_gather", "ring_all_reduce")
])
def test_ring_collectives_honour_the_group(which):
    from minitrain.runtime import LaunchError

    try:
        results = launch(_ring_in_a_group, 3, which, timeout=60)
    except LaunchError as exc:
        if "NotImplementedError" in str(exc):
            raise
        raise AssertionError(
            f"{which} on the group of global ranks 0 and 2 (of 3) did not finish: "
            f"{str(exc).splitlines()[0]} — does a rank send to or wait for a rank outside the "
            f"group? Pass `group` on (ring_neighbours(group), exchange(..., group))") from None
    for rank in (0, 2):
        got, want = results[rank]
        assert got == want, (
            f"{which} on the group of global ranks 0 and 2 (of 3): rank {rank} holds {got}, "
            f"expected {want} — the ring, its chunks and the ranks are the group's: pass "
            f"`group` on (ring_neighbours(group), exchange(..., group))")


@pytest.mark.exercise("DataParallel._on_grad_ready", points=1)
def test_no_launch_during_backward_with_overlap_off():
    results = launch(_train, 2, dict(bucket_cap_mb=0.0005, overlap=False), timeout=60)
    for rank, (diff, overlapped) in enumerate(results):
        assert not overlapped, (
            f"rank {rank}: DataParallel(overlap=False) started an all-reduce before backward "
            "ended — with overlap off the hook launches nothing (the end-of-backward callback "
            "launches every bucket)")
        assert diff < 1e-5, (
            f"overlap off, 2 ranks: rank {rank}'s parameters differ from one process trained "
            f"on the whole batch by {diff:.3g}")
