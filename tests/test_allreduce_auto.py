"""all_reduce(..., "auto") chosen by the α–β model, and the pipelined ring (issue 33).

References: torch's own ``dist.all_reduce`` (gloo) for the sums, the plain exercise ring
for the bits, the α–β formulas written out below for the choice. Speed is checked by
``python -m minitrain.bench allreduce``, not here.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from minitrain import collectives
from minitrain.collectives import LinkCost, LinkCostCache, choose_algorithm
from minitrain.runtime import launch


def _formula(algorithm, n, N, a, b):  # Thakur et al. 2005 / chapter 4, written out again
    if algorithm == "ring":
        return 2 * (N - 1) * a + 2 * (N - 1) / N * n * b
    if algorithm == "naive":
        return 2 * (N - 1) * (a + n * b)
    return math.log2(N) * (a + n * b)  # recursive doubling, N a power of two


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("nbytes", [4, 1024, 2**16, 2**20, 2**22, 2**26])
def test_choose_algorithm_is_the_cheapest_by_the_formulas(world, nbytes):
    link = LinkCost(alpha=1e-4, beta=1e-9)
    times = {a: _formula(a, nbytes, world, 1e-4, 1e-9) for a in ("ring", "naive", "recursive_doubling")}
    assert choose_algorithm(nbytes, world, link) == min(times, key=times.get)


def test_choose_algorithm_crossover_at_world_4():
    # ring 6α + 1.5nβ vs recursive doubling 2α + 2nβ: equal at n = 8α/β
    link = LinkCost(alpha=1e-4, beta=1e-9)
    assert choose_algorithm(700_000, 4, link) == "recursive_doubling"
    assert choose_algorithm(900_000, 4, link) == "ring"


def test_the_reduction_term_makes_two_ranks_use_the_ring_for_large_tensors():
    # world 2: recursive doubling α + nβ + nγ, pipelined ring 2α + nβ (adds hidden): ring once nγ > α
    link = LinkCost(alpha=1e-4, beta=1e-9, gamma=1e-10)
    assert choose_algorithm(500_000, 2, link) == "recursive_doubling"
    assert choose_algorithm(2_000_000, 2, link) == "ring"
    assert choose_algorithm(2_000_000, 2, LinkCost(1e-4, 1e-9)) == "recursive_doubling"


def test_link_cost_rejects_negative_and_all_reduce_names_bad_arguments():
    with pytest.raises(ValueError, match="alpha, beta and gamma"):
        LinkCost(-1.0, 1e-9)
    with pytest.raises(ValueError, match="'fastest'"):
        collectives.all_reduce(torch.ones(3, device="cpu"), "fastest")


def _rank(sizes):
    from minitrain.collectives import (
        LINK_COSTS,
        all_reduce,
        bytes_sent,
        predicted_bytes_sent,
        reset_bytes_sent,
        ring_all_reduce,
        ring_all_reduce_pipelined,
    )  # fmt: skip

    rank, world = dist.get_rank(), dist.get_world_size()
    failures = []
    for n in sizes:
        for dtype in (torch.float32, torch.float64, torch.int64):
            g = torch.Generator(device="cpu").manual_seed(1000 * rank + n)
            x = (torch.randn(n, generator=g, device="cpu") * 100).to(dtype)
            expected = x.clone()
            dist.all_reduce(expected)
            plain = ring_all_reduce(x.clone())
            for seg in (8, 256, 1 << 22):  # many segments per chunk, a few, one
                reset_bytes_sent()
                got = ring_all_reduce_pipelined(x.clone(), segment_bytes=seg)
                if not torch.equal(got, plain):
                    failures.append(f"pipelined != ring: n={n} {dtype} seg={seg}")
                if bytes_sent() != predicted_bytes_sent("ring", n, x.element_size(), rank, world):
                    failures.append(f"pipelined bytes {bytes_sent()}: n={n} {dtype} seg={seg}")
            for link in (LinkCost(1.0, 0.0), LinkCost(0.0, 1.0), None):  # ring, rec. doubling, measured
                got = all_reduce(x.clone(), "auto", link=link)
                if not torch.allclose(got.double(), expected.double(), rtol=1e-4, atol=1e-4):
                    failures.append(f"auto != gloo: n={n} {dtype} link={link}")
    costs = [LINK_COSTS.get(None, "cpu").alpha, LINK_COSTS.get(None, "cpu").beta]
    agreed = torch.tensor(costs, dtype=torch.float64, device="cpu")
    lowest = agreed.clone()
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    same = torch.equal(agreed, lowest)  # every rank uses the same α and β: same choice
    own = LinkCostCache()
    own.set(None, LinkCost(0.0, 1.0))
    y = torch.full((5,), float(rank + 1), device="cpu")
    all_reduce(y, "auto", link=own)  # an explicit cache: used, never measured
    ok_own = own.measurements == 0 and torch.equal(y, torch.full_like(y, world * (world + 1) / 2))
    return failures, LINK_COSTS.measurements, same, ok_own


@pytest.mark.parametrize("world", [3, 4])
def test_pipelined_ring_and_auto_equal_gloo(world):
    for failures, measured, same, ok_own in launch(_rank, world, [0, 1, 2, 5, 37, 1000, 40_001], timeout=180):
        assert failures == []
        assert measured == 1, "α and β must be measured once per group, then kept"
        assert same, "the ranks must agree on α and β, or they pick different algorithms"
        assert ok_own


def _ddp_auto_rank():
    from minitrain.ddp import DataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 300), torch.nn.Tanh(), torch.nn.Linear(300, 4))
    ddp = DataParallel(model, bucket_cap_mb=0.01, communication="auto")  # small and larger buckets
    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(8, 16, device="cpu")
    ddp(x).square().sum().backward()
    local = [p.grad.clone() for p in torch.nn.Sequential(*model).parameters()]
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()  # the same gradients without DataParallel
    worst = 0.0
    for got, p in zip(local, model.parameters()):
        expected = p.grad.clone()
        dist.all_reduce(expected)  # torch's own all-reduce, averaged
        worst = max(worst, (got - expected / dist.get_world_size()).abs().max().item())
    return worst


def test_data_parallel_auto_matches_torch_all_reduce():
    for worst in launch(_ddp_auto_rank, 2, timeout=120):
        assert worst < 1e-5


def test_a_modeled_link_is_taken_as_known_costs():
    # issue 42: chapter 4's LinkCost (what a rank believes) and the runtime's Link (what the
    # modeled network is) meet in one place: "auto" given a Link uses its figures exactly
    from minitrain.collectives.auto import resolve_link
    from minitrain.runtime.link import Link

    cost = resolve_link(Link(alpha=2e-3, bandwidth=5e8), None, "cpu")
    assert cost == LinkCost(alpha=2e-3, beta=2e-9)
    with pytest.raises(TypeError, match="LinkCost, a LinkCostCache, a Link"):
        resolve_link("intra-node", None, "cpu")
