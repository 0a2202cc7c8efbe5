"""minitrain.collectives against torch's own collectives, locally built references and the
byte-count formulas; world sizes 2, 3 and 4, sizes from empty to uneven, fp32/fp16/bf16."""

import pytest
import torch
import torch.distributed as dist

from minitrain.runtime import launch

SIZES = [0, 1, 2, 3, 5, 12, 1001, 4096]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _data(rank, n, dtype, integer):
    g = torch.Generator().manual_seed(1000 * rank + n)
    if integer:  # small integers: every partial sum is exact in every dtype, any order
        return torch.randint(-8, 9, (n,), generator=g).to(dtype)
    return torch.randn(n, generator=g).to(dtype)


def _tolerance(xs, dtype, world):
    # Each of the N-1 additions of a sum rounds once, by at most u = eps/2 of a partial sum
    # bounded by sum|x|; two summation orders therefore differ by at most 2(N-1)·u·sum|x|.
    eps = torch.finfo(dtype).eps
    return (world - 1) * eps * torch.stack([x.double().abs() for x in xs]).sum(0) + 1e-30


def _check_all(world_results):
    failures = [f for res in world_results for f in res]
    assert not failures, "\n".join(failures[:20])


def _collectives_vs_torch():
    from minitrain import collectives as C

    rank, world = dist.get_rank(), dist.get_world_size()
    fails = []
    for dtype in DTYPES:
        for n in SIZES:
            for integer in (True, False):
                xs = [_data(r, n, dtype, integer) for r in range(world)]
                exact_sum = torch.stack([x.double() for x in xs]).sum(0)
                tol = _tolerance(xs, dtype, world) if n else torch.zeros(0)
                oracle = xs[rank].clone()
                dist.all_reduce(oracle)
                for algo in C.ALGORITHMS:
                    t = xs[rank].clone()
                    C.all_reduce(t, algo)
                    if integer and not torch.equal(t.double(), exact_sum):
                        fails.append(f"{algo} n={n} {dtype} rank {rank}: not the exact integer sum")
                    err = (t.double() - oracle.double()).abs()
                    if n and (err > tol).any():
                        fails.append(
                            f"{algo} n={n} {dtype} rank {rank}: differs from torch's "
                            f"all_reduce by {err.max().item():.3g}"
                        )
                    # every rank must hold the same bits
                    gathered = [torch.empty_like(t) for _ in range(world)]
                    dist.all_gather(gathered, t)
                    if not all(torch.equal(g, gathered[0]) for g in gathered):
                        fails.append(f"{algo} n={n} {dtype}: ranks disagree")
                # reduce-scatter: rank r's tensor_split chunk of the sum
                sizes = [len(c) for c in torch.arange(n).tensor_split(world)]
                out = torch.empty(sizes[rank], dtype=dtype)
                before = xs[rank].clone()
                C.ring_reduce_scatter(out, xs[rank])
                if not torch.equal(before, xs[rank]):
                    fails.append(f"ring_reduce_scatter n={n}: modified its input")
                ref = oracle.tensor_split(world)[rank]
                if n % world == 0 and n:
                    ref = torch.empty(n // world, dtype=dtype)
                    dist.reduce_scatter_tensor(ref, xs[rank].clone())
                err = (out.double() - ref.double()).abs()
                if integer and not torch.equal(out.double(), exact_sum.tensor_split(world)[rank]):
                    fails.append(f"ring_reduce_scatter n={n} {dtype}: not the exact integer sum")
                if out.numel() and (err > tol.tensor_split(world)[rank]).any():
                    fails.append(
                        f"ring_reduce_scatter n={n} {dtype} rank {rank}: off by "
                        f"{err.max().item():.3g}"
                    )
                # all-gather: rank r's input is chunk r of the output
                mine = xs[rank][: sizes[rank]].clone()
                expected = torch.cat([xs[r][: sizes[r]] for r in range(world)])
                out = torch.full((n,), float("nan"), dtype=dtype)
                C.ring_all_gather(out, mine)
                if not torch.equal(out, expected):
                    fails.append(f"ring_all_gather n={n} {dtype} rank {rank}: wrong layout")
                if n % world == 0 and n:
                    ref = torch.empty(n, dtype=dtype)
                    dist.all_gather_into_tensor(ref, mine)
                    if not torch.equal(out, ref):
                        fails.append(f"ring_all_gather n={n}: differs from all_gather_into_tensor")
    # shapes other than 1-D, in place
    x = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) * (rank + 1)
    C.ring_all_reduce(x)
    expected = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) * sum(range(1, world + 1))
    if not torch.equal(x, expected):
        fails.append("ring_all_reduce of a 3-D tensor is wrong")
    return fails


@pytest.mark.parametrize("world", [2, 3, 4])
def test_collectives_equal_torch(world):
    _check_all(launch(_collectives_vs_torch, world, timeout=120))


def _bytes():
    from minitrain import collectives as C

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for n in (0, 1, 3, 12, 1001, 4096):
        for dtype in (torch.float32, torch.bfloat16):
            for algo in C.ALGORITHMS:
                C.reset_bytes_sent()
                C.all_reduce(torch.ones(n, dtype=dtype), algo)
                out[(algo, n, dtype)] = (
                    C.bytes_sent(),
                    C.predicted_bytes_sent(
                        algo, n, 2 if dtype != torch.float32 else 4, rank, world
                    ),
                )
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_bytes_sent_match_formulas(world):
    results = launch(_bytes, world, timeout=60)
    for rank, res in enumerate(results):
        for (algo, n, dtype), (measured, predicted) in res.items():
            es = 2 if dtype == torch.bfloat16 else 4
            assert measured == predicted, (algo, n, dtype, rank, measured, predicted)
            sizes = [len(c) for c in torch.arange(n).tensor_split(world)]
            if algo == "ring":
                # reduce-scatter sends every chunk but our own, all-gather every chunk but r+1's
                assert measured == (2 * n - sizes[rank] - sizes[(rank + 1) % world]) * es
                if n % world == 0:
                    assert measured * world == 2 * (world - 1) * n * es  # 2(N-1)/N of the tensor
            if algo == "naive":
                assert measured == ((world - 1) * n if rank == 0 else n) * es
    # the root of the naive algorithm sends more than any rank of the ring
    n = 4096
    ring_max = max(res[("ring", n, torch.float32)][0] for res in results)
    naive_root = results[0][("naive", n, torch.float32)][0]
    assert naive_root >= ring_max and (world == 2 or naive_root > ring_max)


def _bad_input():
    from minitrain import collectives as C

    msgs = []
    for call in (
        lambda: C.ring_reduce_scatter(torch.empty(3), torch.empty(10)),
        lambda: C.ring_all_gather(torch.empty(10), torch.empty(4)),
        lambda: C.ring_all_reduce(torch.empty(4, 4).t()),
        lambda: C.ring_reduce_scatter(torch.empty(5, dtype=torch.float16), torch.empty(10)),
        lambda: C.all_reduce(torch.empty(4), "butterfly"),
    ):
        try:
            call()
            msgs.append(None)
        except (ValueError, TypeError) as exc:
            msgs.append(str(exc))
    return msgs


def test_bad_input_raises_clear_errors():
    msgs = launch(_bad_input, 2, timeout=60)[0]
    assert msgs[0] and "3 elements" in msgs[0] and "5" in msgs[0]
    assert msgs[1] and "4 elements" in msgs[1]
    assert msgs[2] and "contiguous" in msgs[2]
    assert msgs[3] and "dtype" in msgs[3]
    assert msgs[4] and "butterfly" in msgs[4]


def test_chunk_sizes_match_tensor_split():
    from minitrain.collectives import chunk_sizes

    for n in range(0, 20):
        for world in range(1, 6):
            assert chunk_sizes(n, world) == [len(c) for c in torch.arange(n).tensor_split(world)]


def test_alpha_beta_fit_recovers_a_line_and_predictions_follow_the_formulas():
    from minitrain.collectives.cost_model import fit_alpha_beta, predict_all_reduce

    alpha, beta = 50e-6, 1e-9
    sizes = [64, 4096, 2**20, 2**24]
    a, b = fit_alpha_beta(sizes, [alpha + beta * m for m in sizes])
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)
    n = 2**20
    assert predict_all_reduce("ring", n, 4, alpha, beta) == pytest.approx(
        6 * alpha + 1.5 * n * beta
    )
    assert predict_all_reduce("naive", n, 4, alpha, beta) == pytest.approx(6 * alpha + 6 * n * beta)
    assert predict_all_reduce("recursive_doubling", n, 4, alpha, beta) == pytest.approx(
        2 * alpha + 2 * n * beta
    )
    with pytest.raises(ValueError, match="equal"):
        fit_alpha_beta([8, 8], [1.0, 2.0])
