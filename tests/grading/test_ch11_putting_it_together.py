"""Graded tests of chapter 11: your mesh coordinates and groups, and your parameter count per
rank — each against an independent reference (itertools' enumeration of the grid; the
parameters a real tensor- and pipeline-parallel model holds)."""

import itertools

import pytest
import torch
import torch.distributed as dist

from minitrain.model import GPTConfig
from minitrain.runtime import launch

LAYOUTS = [dict(dp=2, tp=2, pp=2), dict(tp=2, pp=2, cp=2), dict(dp=3, tp=2), dict(dp=4, pp=2),
           dict(dp=2, tp=4, pp=3, cp=2)]


def _sizes(layout):
    return {a: layout.get(a, 1) for a in ("dp", "tp", "pp", "cp")}


@pytest.mark.exercise("rank_coords", points=2)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_rank_coords_enumerate_the_grid_tp_fastest(layout):
    from minitrain.parallel import rank_coords

    s = _sizes(layout)
    grid = itertools.product(range(s["pp"]), range(s["dp"]), range(s["cp"]), range(s["tp"]))
    for rank, want in enumerate(grid):
        got = tuple(rank_coords(rank, **s))
        assert got == want, (
            f"rank_coords({rank}, {s}) returned (pp, dp, cp, tp) = {got}, expected {want}: "
            "tp is the fastest-changing digit, pp the slowest")


@pytest.mark.exercise("axis_groups", points=2)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_axis_groups_hold_ranks_differing_in_one_coordinate(layout):
    from minitrain.parallel import axis_groups

    s = _sizes(layout)
    grid = list(itertools.product(range(s["pp"]), range(s["dp"]), range(s["cp"]), range(s["tp"])))
    for i, axis in enumerate(("pp", "dp", "cp", "tp")):
        want = {}
        for rank, c in enumerate(grid):  # reference: group ranks by their other coordinates
            want.setdefault(c[:i] + c[i + 1:], []).append(rank)
        want = sorted(want.values())
        got = axis_groups(axis, **s)
        assert got == want, f"axis_groups({axis!r}, {s}) returned {got}, expected {want}"


def _real_params(config, tp, pp):
    """On each rank: the parameters its stage of the real TP × PP model holds."""
    from minitrain.model import GPT
    from minitrain.parallel import DeviceMesh
    from minitrain.pipeline import PipelineStage
    from minitrain.tensor_parallel import apply_tensor_parallel

    mesh = DeviceMesh(tp=tp, pp=pp)
    torch.manual_seed(0)
    model = GPT(config)
    if tp > 1:
        apply_tensor_parallel(model, mesh.group("tp"))
    if pp > 1:
        PipelineStage(model, mesh.group("pp"))
    return dist.get_rank(), tuple(mesh.coords()), sum(p.numel() for p in model.parameters())


@pytest.mark.exercise("params_per_rank", points=3)
@pytest.mark.parametrize("config, tp, pp", [
    (GPTConfig(n_layer=3), 2, 2),  # 3 blocks over 2 stages: 2 + 1
    (GPTConfig(n_layer=2, bias=False, d_ff=96), 2, 1),
    (GPTConfig(n_layer=4, vocab_size=96, n_head=4), 4, 1),
    (GPTConfig(n_layer=5), 1, 3),
    (GPTConfig(n_layer=2, tie_weights=True), 2, 1),  # the head is the embedding: once
    (GPTConfig(n_layer=2, tie_weights=True, bias=False), 1, 1),
], ids=["tp2-pp2-uneven", "tp2-nobias", "tp4", "pp3", "tp2-tied", "tied-nobias"])
def test_params_per_rank_equals_the_real_model(config, tp, pp):
    from minitrain.parallel import params_per_rank

    for rank, coords, actual in launch(_real_params, tp * pp, config, tp, pp, timeout=120):
        stage = coords[0]
        got = params_per_rank(config, tp, pp, stage)
        tied = " (tie_weights: the head is the token embedding, one matrix)" if config.tie_weights else ""
        nobias = " (bias=False removes biases, not LayerNorm gains)" if not config.bias else ""
        assert got == actual, (
            f"params_per_rank(tp={tp}, pp={pp}, stage={stage}) = {got}, but rank {rank}'s "
            f"stage of the real model holds {actual} parameters{tied}{nobias}")
