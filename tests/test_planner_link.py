"""The planner's communication terms against what the trainer sends on a modeled link (issue 42).

``planner.step_time`` charges each mesh axis the α–β time of the messages it predicts; the
trainer's step on ``minitrain.runtime.link`` is charged, message by message, what
``link_costs`` says. Here each axis gets its own link of the *same* α and β (only the name
differs), so the modeled cost of every message can be added up by axis and compared with
the planner's term for that axis: deterministic (nothing is timed), exact but for the
step's loss average on the DP × CP group, which the planner leaves out (a few α). The timed
side by side (measured vs predicted step times) is ``python -m minitrain.bench planner
--link intra-node`` (notebook 11), not a unit test.
"""

from __future__ import annotations

import collections

import pytest
import torch

from minitrain.bench.planner import BATCH, CONFIG, measure_on_link, short_name
from minitrain.parallel import Cluster, Layout, step_time
from minitrain.runtime import launch
from minitrain.runtime.link import Link

ALPHA, BANDWIDTH = 1e-5, 1e10  # cheap: the ranks barely sleep, the costs are only added up
AXES = ("dp", "tp", "pp", "cp")
LINKS = {axis: Link(ALPHA, BANDWIDTH, axis) for axis in (*AXES, "default")}
LAYOUTS = [dict(dp=4), dict(tp=4), dict(pp=4, microbatches=4), dict(dp=2, tp=2),
           dict(tp=2, pp=2, microbatches=2), dict(dp=2, cp=2), dict(tp=2, cp=2),
           dict(cp=2, pp=2, microbatches=2), dict(cp=4)]


def _modeled_cost_by_axis(layouts):
    """Per layout, the modeled seconds of the messages one step (the second) sends, by the
    link (axis) they went on: collectives as they start, point-to-point as they are sent."""
    from minitrain.parallel import ParallelGPT
    from minitrain.runtime import link_costs, link_messages

    torch.set_num_threads(1)
    costs = collections.Counter()
    collective_time, send = link_costs.collective_time, link_messages.send

    def counted_collective(kind, n, size, link):
        seconds = collective_time(kind, n, size, link)
        costs[link.name] += seconds
        return seconds

    def counted_send(group, link, tensor, dst, tag):
        costs[link.name] += link_costs.p2p_time(link_messages.nbytes(tensor), link)
        return send(group, link, tensor, dst, tag)

    out = []
    for layout in layouts:
        job = ParallelGPT(CONFIG, layout, BATCH, 1e-3, 0)
        job.step(0)  # the first step also exchanges shapes
        costs.clear()
        link_costs.collective_time, link_messages.send = counted_collective, counted_send
        try:
            job.step(1)
        finally:
            link_costs.collective_time, link_messages.send = collective_time, send
        out.append(dict(costs))
    return out


@pytest.mark.slow
def test_planner_charges_each_axis_what_the_trainer_sends_on_the_link():
    results = launch(_modeled_cost_by_axis, 4, LAYOUTS, link=LINKS, timeout=300)
    cluster = Cluster(4, 4, 1e12, BANDWIDTH, BANDWIDTH, 1e12, alpha=ALPHA)
    for i, layout in enumerate(LAYOUTS):
        parts = step_time(CONFIG, Layout(**layout), CONFIG.seq_len, BATCH, cluster, "fp32")
        for axis in AXES:
            # the busiest rank: a middle pipeline stage sends both ways, an end one way
            sent = max(rank[i].get(axis, 0.0) for rank in results)
            # dp: + the step's loss averaged over DP × CP, one all-reduce of one float
            slack = 2 * 3 * ALPHA * 1.01 if axis == "dp" else 1e-9
            assert abs(parts[axis] - sent) <= slack + 1e-6 * sent, (
                f"{short_name(Layout(**layout))}: the planner charges {axis} "
                f"{parts[axis] * 1e3:.3f} ms, the trainer's messages cost {sent * 1e3:.3f} ms")


def test_measure_on_link_refuses_a_link_per_axis():
    with pytest.raises(TypeError, match="one Link"):
        measure_on_link({"tp": "intra-node", "dp": "inter-node"})
