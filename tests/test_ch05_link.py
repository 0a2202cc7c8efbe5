"""Chapter 5 on a modeled link (issue 42): prefetch's measurement helpers (minitrain.fsdp.measure).

``measured(cls, expose=True)`` must change only the overlap, never the collectives or the results;
``predicted_step`` must charge what the schedule exposes. The timing check is slow and
generous: what notebooks/05_zero.ipynb compares (waited < 0.6× without prefetch, whose
formula is 0.25-0.3× here; the exposed waits at least 0.8× their sleep-based formula: a busy
machine only adds to a modeled wait)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from timing_checks import measured_twice

from minitrain.fsdp.measure import measure_prefetch, predicted_step
from minitrain.runtime import launch
from minitrain.runtime.link import Link
from minitrain.runtime.link_costs import all_gather_time, reduce_scatter_time

L = Link(1e-3, 50e6, "test")
SIZES = {"blocks": [400_000] * 4, "root": 40_000, "reduce": [400_000] * 4, "root_reduce": 40_000}


def test_prediction_without_prefetch_waits_for_every_gather():
    g, root = all_gather_time(400_000, 2, L), all_gather_time(40_000, 2, L)
    p = predicted_step(0.1, 0.0, 0.0, SIZES, 2, L, prefetch=False)
    assert p["waits"] == pytest.approx(8 * g + 2 * root)
    tail = reduce_scatter_time(400_000, 2, L) + reduce_scatter_time(40_000, 2, L)
    assert p["step"] == pytest.approx(0.1 + 8 * g + 2 * root + tail)


def test_prediction_with_prefetch_hides_all_but_the_first_of_each_pass():
    g, root = all_gather_time(400_000, 2, L), all_gather_time(40_000, 2, L)
    hidden = predicted_step(0.1, g, 2 * g, SIZES, 2, L)  # each block computes ≥ a gather
    assert hidden["waits"] == pytest.approx(2 * g + 2 * root)
    short = predicted_step(0.1, g / 2, g / 2, SIZES, 2, L)  # half of 6 gathers stays exposed
    assert short["waits"] == pytest.approx(2 * g + 2 * root + 6 * g / 2)
    assert hidden["step"] < short["step"] < predicted_step(0.1, g, 2 * g, SIZES, 2, L,
                                                           prefetch=False)["step"]


def _train(kind, expose):
    from minitrain import zero
    from minitrain.fsdp import FullyShardedDataParallel
    from minitrain.fsdp.measure import measured
    from minitrain.model import GPT, GPTConfig, lm_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, n_layer=3, n_head=2, d_model=16))
    if kind == "fsdp":
        m = measured(FullyShardedDataParallel, expose)(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        step, zero_grad = opt.step, opt.zero_grad
    else:
        m = measured(zero.ZeroDataParallel, expose)(model, torch.optim.AdamW, 3, lr=1e-2)
        step, zero_grad = m.step, m.zero_grad
    g = torch.Generator(device="cpu").manual_seed(dist.get_rank())
    x = torch.randint(0, 32, (2, 8), generator=g, device="cpu")
    for _ in range(3):
        zero_grad()
        lm_loss(m(x), x).backward()
        step()
    shards = [u.shard.detach().clone() for u in m.live_units()]
    return shards, len(m.gather_waits)


@pytest.mark.parametrize("kind", ["zero3", "fsdp"])
def test_exposing_the_gathers_changes_no_result(kind):
    for (plain, n_plain), (exposed, n_exposed) in zip(launch(_train, 2, kind, False),
                                                      launch(_train, 2, kind, True)):
        assert all(torch.equal(a, b) for a, b in zip(plain, exposed))
        assert n_plain > 0 and n_exposed > n_plain  # the waits were counted, and added


def _check_prefetch_hides():
    config = dict(vocab_size=64, seq_len=32, n_layer=4, n_head=4, d_model=128, bias=False)
    run = measure_prefetch("fsdp", config, batch=16, steps=4, ratio=0.8)
    w, p = run["waited"], run["predicted"]
    assert w["prefetch"] < 0.6 * w["exposed"], w
    assert w["exposed"] > 0.8 * p["exposed"]["waits"], (w, p["exposed"])


@pytest.mark.slow
def test_prefetch_hides_the_gathers_on_a_link():
    measured_twice(_check_prefetch_hides)
