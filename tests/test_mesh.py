"""minitrain.parallel.mesh: coordinates, groups (built and really communicating), clear errors."""

import itertools

import pytest
import torch
import torch.distributed as dist

from minitrain.model import GPTConfig
from minitrain.parallel import AXES, axis_groups, check_layout, rank_coords
from minitrain.runtime import LaunchError, launch

LAYOUTS = [dict(dp=2, tp=2, pp=2), dict(tp=2, pp=2, cp=2), dict(dp=4, pp=2), dict(dp=3, tp=2),
           dict(dp=1, tp=1, pp=1, cp=1), dict(dp=2, tp=4, pp=3, cp=2)]


def layout_id(layout):
    """A test id without spaces or quotes: dp2-tp2-pp2-microbatches2."""
    return "-".join(f"{k}{v}" for k, v in layout.items()) or "single"


def _full(layout):
    return {a: layout.get(a, 1) for a in ("dp", "tp", "pp", "cp")}


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_coordinates_enumerate_the_grid_tp_fastest_pp_slowest(layout):
    s = _full(layout)
    # reference: itertools.product enumerates the grid with the last axis fastest
    grid = list(itertools.product(range(s["pp"]), range(s["dp"]), range(s["cp"]), range(s["tp"])))
    for rank, expected in enumerate(grid):
        c = rank_coords(rank, **s)
        assert tuple(c) == expected, f"rank {rank}: {tuple(c)} != {expected}"
        assert c["tp"] == c.tp == expected[3]


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_groups_partition_the_world_and_cross_in_one_rank(layout):
    s = _full(layout)
    world = s["dp"] * s["tp"] * s["pp"] * s["cp"]
    for axis in AXES:
        groups = axis_groups(axis, **s)
        assert sorted(r for g in groups for r in g) == list(range(world)), axis
        assert all(len(g) == s[axis] for g in groups)
        for g in groups:  # members differ only along `axis`, in coordinate order
            cs = [rank_coords(r, **s) for r in g]
            assert [c[axis] for c in cs] == list(range(s[axis]))
            others = {tuple(v for a, v in c._asdict().items() if a != axis) for c in cs}
            assert len(others) == 1
    for g in axis_groups("tp", **s):  # TP ranks adjacent
        assert g == list(range(g[0], g[0] + len(g)))
    stage = s["dp"] * s["cp"] * s["tp"]
    for r in range(world):  # PP outermost: a stage is a contiguous block of ranks
        assert rank_coords(r, **s).pp == r // stage


def test_example_from_the_docstring():
    assert axis_groups("tp", dp=2, tp=2, pp=2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axis_groups("pp", dp=2, tp=2, pp=2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert axis_groups("dp", dp=2, tp=2, pp=2) == [[0, 2], [1, 3], [4, 6], [5, 7]]


def _sum_over_each_axis(layout):
    from minitrain.parallel import DeviceMesh

    mesh = DeviceMesh(**layout)
    out = {"coords": tuple(mesh.coords()), "ranks": {}, "sums": {}}
    for axis in (*AXES, "dp_cp"):
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=mesh.group(axis))
        out["sums"][axis] = t.item()
        out["ranks"][axis] = mesh.ranks(axis)
    return out


def test_mesh_groups_really_communicate_8_ranks():
    layout = dict(dp=2, tp=2, pp=2)
    results = launch(_sum_over_each_axis, 8, layout, timeout=120)
    s = _full(layout)
    for rank, res in enumerate(results):
        assert res["coords"] == tuple(rank_coords(rank, **s))
        for axis in AXES:
            mine = next(g for g in axis_groups(axis, **s) if rank in g)
            assert res["ranks"][axis] == mine
            assert res["sums"][axis] == sum(mine), (rank, axis)


def _mesh(layout):
    from minitrain.parallel import DeviceMesh

    DeviceMesh(**layout)


def test_product_not_world_size_is_a_clear_error():
    with pytest.raises(LaunchError, match=r"dp=2 × tp=2 × pp=1 × cp=1 = 4 ranks, but the world size is 2"):
        launch(_mesh, 2, dict(dp=2, tp=2), timeout=60)


def test_tp_not_dividing_heads_is_a_clear_error():
    cfg = GPTConfig(n_head=4, d_model=48, vocab_size=48)
    with pytest.raises(ValueError, match="tensor parallel size 3 does not divide 4 attention heads"):
        check_layout(cfg, tp=3)
    with pytest.raises(ValueError, match="pipeline size 3 does not divide 2 layers"):
        check_layout(GPTConfig(), pp=3)
    with pytest.raises(ValueError, match="global batch 6 is not a multiple of dp=4"):
        check_layout(GPTConfig(), dp=4, batch_size=6)
    check_layout(GPTConfig(), dp=2, tp=2, pp=2, batch_size=8)  # a good one passes


def test_uneven_pipeline_stages_pass_as_the_planner_proposes_them():
    """Issue 26: the planner proposes pp up to the layers (Llama 3 405B: 126 layers, PP16;
    split_blocks gives the extras to the first stages), so the check must not ask pp | L."""
    check_layout(GPTConfig(n_layer=3), pp=2)
    check_layout(GPTConfig(n_layer=126), pp=16)
