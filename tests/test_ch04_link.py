"""Chapter 4 on the modeled link (issue 42): the α–β fit recovers a link, the DDP link and step
model of section 6, the trace's predicted gain, and measure(link=function) sizing a link.

Timing checks use a slow link (α 15 ms, as tests/test_link.py) so that this machine's own
overhead stays small beside it, and are measured twice on a miss (``timing_checks.measured_twice``)."""

import math

import pytest
from timing_checks import measured_twice

from minitrain.collectives import cost_model
from minitrain.ddp.measure import exposed_after_backward, predicted_gain
from minitrain.runtime import launch, link_costs
from minitrain.runtime.link import Link
from minitrain.runtime.trace import Event

L = Link(15e-3, 125e6, "test")
KIB, MIB = 1024, 1024 * 1024


def test_link_for_overlap_makes_one_all_reduce_as_long_as_backward():
    for world in (2, 4):
        link = cost_model.link_for_overlap(0.02, 3 * MIB, world, alpha_share=0.05)
        assert link.alpha == pytest.approx(0.001)
        assert link_costs.all_reduce_time(3 * MIB, world, link) == pytest.approx(0.02)
    assert "backward's 20.0 ms" in cost_model.link_for_overlap(0.02, MIB).basis


def test_modeled_step_trades_bucket_count_times_alpha_against_overlap():
    backward, other, total = 0.010, 0.002, 4 * MIB
    flat, buckets4, per_param = [total], [total // 4] * 4, [total // 64] * 64
    for share, best in ((0.005, "4"), (0.2, "flat")):
        link = cost_model.link_for_overlap(backward, total, alpha_share=share)
        after = cost_model.modeled_step(flat, backward, other, link, overlap=False)
        assert after == pytest.approx(other + 2 * backward)  # comm = backward, nothing hidden
        steps = {"flat": cost_model.modeled_step(flat, backward, other, link),
                 "4": cost_model.modeled_step(buckets4, backward, other, link),
                 "64": cost_model.modeled_step(per_param, backward, other, link)}
        assert min(steps, key=steps.get) == best, (share, steps)
    # 4 equal buckets, α negligible: the last quarter is left after backward
    tiny = cost_model.link_for_overlap(backward, total, alpha_share=1e-6)
    assert cost_model.modeled_step(buckets4, backward, 0.0, tiny) == pytest.approx(1.25 * backward,
                                                                                   rel=1e-3)


def _step(backward_end, launches, start=0.0):
    events = [Event("forward", "compute", start, start + 0.001),
              Event("backward", "compute", start + 0.001, backward_end)]
    events += [Event(f"all-reduce bucket {i}", "communication", t, t + 0.5)  # ends: ignored
               for i, t in enumerate(launches)]
    return events


def test_exposed_after_backward_queues_the_launches_on_the_link():
    link = Link(1e-3, 1e6)  # 1 ms + 1 µs per byte; world 2: 2 ms + n µs per all-reduce
    one = link_costs.all_reduce_time(1000, 2, link)
    assert one == pytest.approx(0.003)
    # launched at 2 and 3 ms, backward ends at 10 ms: both done by 8 ms, nothing exposed
    assert exposed_after_backward(_step(0.010, [0.002, 0.003]), [1000, 1000], link, 2) == 0.0
    # launched at 9 and 9.5 ms: the second queues behind the first, ends at 15 ms
    ev = _step(0.010, [0.009, 0.0095])
    assert exposed_after_backward(ev, [1000, 1000], link, 2) == pytest.approx(0.005)
    flat = _step(0.010, [0.010])
    result = {"link": link, "world": 2, "bucket_bytes": {"flat": [2000], "b": [1000, 1000]},
              "step_traces": {"flat": [[flat, flat]], "b": [[ev, ev]]}}
    # flat: 4 ms after backward; bucketed: 5 ms — overlap predicted to lose 1 ms
    assert predicted_gain(result, "flat", "b") == pytest.approx(-0.001)
    # a longer traced backward (tracing's own cost) is not what overlap saves: left out
    result["step_traces"]["b"] = [[_step(0.012, [0.011, 0.0115])] * 2]
    assert predicted_gain(result, "flat", "b") == pytest.approx(-0.001)


def test_overlap_verdict_reads_the_three_checks():
    from minitrain.bench import ddp as bench_ddp

    link = Link(1e-3, 1e6)
    flat, bucketed = _step(0.010, [0.010]), _step(0.010, [0.002, 0.004])
    result = {"link": link, "world": 2,
              "bucket_bytes": {bench_ddp.FLAT: [2000], bench_ddp.BUCKETED: [1000, 1000]},
              "step_traces": {bench_ddp.FLAT: [[flat, flat]], bench_ddp.BUCKETED: [[bucketed] * 2]},
              "step_ratio": {bench_ddp.BUCKETED: 0.72},
              "slowest": {bench_ddp.FLAT: [0.016, 0.0165], bench_ddp.BUCKETED: [0.0118, 0.0124]}}
    v = bench_ddp.overlap_verdict(result)
    assert v["predicted"] == pytest.approx(0.004)  # flat's 4 ms after backward, all hidden
    assert v["gain"] == pytest.approx(0.00415)
    assert v["beat"] and v["target"] and v["as_predicted"]
    result["step_ratio"][bench_ddp.BUCKETED] = 0.85
    result["slowest"][bench_ddp.BUCKETED] = [0.0150, 0.0155]
    v = bench_ddp.overlap_verdict(result)
    assert v["beat"] and not v["target"] and not v["as_predicted"]


def _fit_on_link(sizes):
    return cost_model.measure_ring_step(sizes, reps=3)


@pytest.mark.slow
def test_the_fit_recovers_the_links_alpha_and_beta():
    sizes = [4 * KIB, 256 * KIB, MIB, 2 * MIB]

    def check():
        steps = launch(_fit_on_link, 2, sizes, link=L, timeout=240)[0]
        alpha, beta = cost_model.fit_alpha_beta(sizes, steps)
        assert alpha == pytest.approx(L.alpha, rel=0.1) and 1 / beta == pytest.approx(
            L.bandwidth, rel=0.1), (alpha, 1 / beta)

    measured_twice(check)


def test_measure_sizes_a_link_to_the_runs_backward():
    from minitrain.ddp.measure import measure

    tiny = dict(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=32)
    seen = []

    def sized(backward):
        seen.append(backward)
        return Link(backward / 100, 1e9, "sized")

    variants = {"flat": dict(bucket_cap_mb=math.inf, overlap=False),
                "bucketed": dict(bucket_cap_mb=0.001, overlap=True)}
    result = measure(variants, tiny, steps=1, link=sized, reference="flat")
    assert result["link"].name == "sized" and result["link"].alpha > 0
    assert result["world"] == 2 and len(result["bucket_bytes"]["bucketed"]) > 1
    assert sum(result["bucket_bytes"]["flat"]) == sum(result["bucket_bytes"]["bucketed"])
    assert set(result["slowest"]) == set(variants)
    assert not seen  # called in the ranks, not here
