"""Chapter 7 on a modeled link (issue 42): ``measure.predicted_step`` is ``simulate``'s makespan
with real durations and α + n/β per message, and a pipeline's measured step matches it; the
calibrated-sleep stage follows the chapter's one cost convention (F = 1, a whole backward 2)."""

import statistics
from fractions import Fraction

import pytest
from timing_checks import measured_twice

from minitrain.pipeline import make_schedule, simulate
from minitrain.pipeline.check import chunk_costs
from minitrain.pipeline.measure import WHOLE_BACKWARD, action_seconds, predicted_step, run_pipelines
from minitrain.runtime.link import Link
from minitrain.runtime.trace import Event

CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1)]


def _durations(schedule, p, m, v, costs):
    return [{(k, mb, c): float(Fraction(costs.get(k, 1)) / v) for k in "FBW" for mb in range(m)
             for c in range(v)} for _ in range(p)]


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (3, 5), (4, 8)])
def test_without_messages_it_is_simulates_makespan(p, m):
    for name, v in CASES:
        schedule = make_schedule(name, p, m, v)
        costs = {"F": 1, "B": 1, "W": 1} if name == "zero_bubble" else WHOLE_BACKWARD
        want = simulate(schedule, chunk_costs(v, costs), num_chunks=v).makespan
        assert predicted_step(schedule, _durations(schedule, p, m, v, costs), 0.0, v) == float(want)


def test_messages_delay_the_receiver_and_queue_on_the_senders_link():
    # GPipe p = 2, m = 2, F = B = 1, a message 3: F0 leaves at 1, arrives 4; F1 is done at 2 but
    # the link is busy until 4, arrives 7; stage 1: F0 4-5, F1 7-8, B1 8-9 (arrives 12), B0 9-10
    # (leaves 12, arrives 15); stage 0: B1 12-13, B0 15-16
    schedule = make_schedule("gpipe", 2, 2, 1)
    assert predicted_step(schedule, _durations(schedule, 2, 2, 1, {"F": 1, "B": 1}), 3.0) == 16.0
    # a message between two chunks on one rank never leaves it: p = 1 is free
    one = make_schedule("1f1b", 1, 3, 1)
    assert predicted_step(one, _durations(one, 1, 3, 1, {"F": 1, "B": 2}), 5.0) == 9.0


def test_action_seconds_reads_the_traced_spans():
    events = [Event("F0", "compute", 0.0, 1.0), Event("recv B0", "communication", 1.0, 2.0),
              Event("B0.1", "compute", 2.0, 4.5), Event("W3", "compute", 5.0, 5.25)]
    assert action_seconds([events]) == [{("F", 0, 0): 1.0, ("B", 0, 1): 2.5, ("W", 3, 0): 0.25}]


@pytest.mark.slow
def test_sleep_stage_on_a_link_matches_the_prediction_and_the_convention():
    unit = 0.02
    link = Link(2 * unit, 1e9, "test")  # a message costs two forwards: it shows in the step

    def check():
        result = run_pipelines("sleep", 2, 2, CASES, unit=unit, repeats=3, link=link)
        for (name, _), e in result.items():
            ratio = statistics.median(t / p for t, p in zip(e["step_seconds"], e["predicted_seconds"]))
            assert abs(ratio - 1) <= 0.2, (name, ratio)
            assert statistics.median(e["predicted_seconds"]) > 1.2 * statistics.median(
                e["predicted_compute_only"]), name  # the messages are on the critical path
        # one convention: 1F1B's whole backward sleeps 2 units, ZB-H1's B and W one each
        assert result[("1f1b", 1)]["simulation"].makespan == 9
        assert result[("zero_bubble", 1)]["simulation"].makespan == 7
        b = [d for (k, _, _), d in action_seconds(result[("1f1b", 1)]["events"])[0].items() if k == "B"]
        assert statistics.median(b) == pytest.approx(2 * unit, rel=0.25)
        zb = action_seconds(result[("zero_bubble", 1)]["events"])[0]
        for kind in "BW":  # W runs no autograd: SleepStage's W sleeps its unit
            assert statistics.median(d for (k, _, _), d in zb.items() if k == kind) == pytest.approx(
                unit, rel=0.25), kind

    measured_twice(check)
