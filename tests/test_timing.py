"""``minitrain.runtime.slowest_rank_seconds``: one call timed on every rank at once, every rank
given the slowest rank's seconds (what the benchmarks and the α–β fit of "auto" measure).

The reference is the sleep itself: a rank that sleeps s seconds takes at least s, so the
slowest rank's time is at least the longest sleep, on every rank."""

import time

import torch
import torch.distributed as dist

from minitrain.runtime import launch, slowest_rank_seconds

SLEEP = 0.4  # seconds rank 1 sleeps inside the timed call


def _rank(sleep: float):
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])  # rank 2 takes part in no call: the group is the pair's
    out = {}
    if rank in (0, 1):
        def nap(r):
            time.sleep(sleep if r == 1 else 0.0)
            return r

        out["slowest"] = slowest_rank_seconds(nap, rank, device="cpu", group=pair)
        if rank == 0:  # rank 0 comes late: the barrier starts both clocks when it arrives
            time.sleep(sleep)
        tiny = torch.ones(1, device="cpu")  # a collective of the pair: waits for both
        out["together"] = slowest_rank_seconds(
            lambda t: dist.all_reduce(t, group=pair), tiny, group=pair, device="cpu")[0]
    dist.barrier()
    return out


def test_every_rank_gets_the_slowest_ranks_seconds_and_its_own_result():
    ranks = launch(_rank, 3, SLEEP, timeout=120)
    (s0, r0), (s1, r1) = ranks[0]["slowest"], ranks[1]["slowest"]
    assert (r0, r1) == (0, 1), "fn's own result comes back on each rank"
    assert s0 == s1, "every rank of the group must hold the same number"
    assert s0 >= SLEEP, f"rank 0 reports {s0:.3f} s, not the slowest rank's (>= {SLEEP} s)"
    assert ranks[2] == {}
    # a rank arriving late does not count: the clocks start after the barrier
    assert ranks[0]["together"] < SLEEP / 2 and ranks[1]["together"] < SLEEP / 2, ranks
