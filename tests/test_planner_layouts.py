"""Every layout the planner proposes builds and trains (issue 26, item 7).

``minitrain.parallel.enumerate_layouts`` lists DP × TP(+SP) × PP × CP × ZeRO × recomputation ×
micro-batch layouts; each must run in ``minitrain.parallel.ParallelGPT`` and give the single
process's losses. The optimizer is SGD with lr = 1: a gradient off by a constant factor (a sum
instead of a mean, a LayerNorm gradient counted t times) changes the next loss by about as
much as the step itself, where AdamW's m / sqrt(v) would cancel it.

One launch per world size loops over the layouts inside the ranks (a mesh per distinct
dp × tp × pp × cp, reused). ``make test`` runs a covering subset (``pairwise``: every mesh
shape with every value of every other option, and every two options' values together — 30 of
132 layouts on 4 devices, 30 of 84 on 8); ``MINITRAIN_SWEEP=full`` (``make sweep``) runs them
all, about 10 minutes on two cores: a bug that needs three options at once shows only there.
"""

import itertools
import os

import pytest

from minitrain.model import GPTConfig
from minitrain.parallel import enumerate_layouts, layout_dict, single_process_losses
from minitrain.runtime import launch

# tiny, and uneven: 3 layers over 2 stages (extras to the first, as split_blocks cuts them)
CFG = GPTConfig(vocab_size=16, seq_len=16, n_layer=3, n_head=4, d_model=16)
LR, SEED, STEPS = 1.0, 0, 2
# the global batch per world size: 4 sequences on 4 devices (DP up to 4, DP with PP); 2 on 8
# keeps its 84 layouts (of 168 with 4) within budget, every mesh shape but DP ≥ 2 with PP
BATCH = {4: 4, 8: 2}


def _train_every_layout(layouts, batch):
    """On every rank: each layout for STEPS steps, meshes shared by layouts of one shape."""
    from minitrain.parallel import DeviceMesh, ParallelGPT

    meshes, out = {}, []
    for layout in layouts:
        shape = tuple(layout[k] for k in ("dp", "tp", "pp", "cp"))
        if shape not in meshes:
            meshes[shape] = DeviceMesh(*shape)
        try:
            job = ParallelGPT(CFG, layout, batch, LR, SEED, mesh=meshes[shape])
            out.append([job.step(step) for step in range(STEPS)])
        except ValueError as exc:  # a refusal, reported with its layout (no collective ran)
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def planner_layouts(devices):
    return [dict(layout_dict(lo), optimizer="sgd")
            for lo in enumerate_layouts(CFG, CFG.seq_len, BATCH[devices], devices, devices)]


def pairwise(layouts):
    """A subset covering every (mesh shape, option value) and every two options' values that
    occur together in ``layouts``; greedy, first-listed on ties, so the same every run."""
    mesh = ("dp", "tp", "pp", "cp")

    def pairs(lo):
        shape, options = tuple(lo[k] for k in mesh), [(k, v) for k, v in lo.items() if k not in mesh]
        return {(shape, None)} | {(shape, o) for o in options} | set(itertools.combinations(options, 2))

    wanted, chosen = set().union(*map(pairs, layouts)), []
    while wanted:
        best = max(layouts, key=lambda lo: len(pairs(lo) & wanted))
        chosen.append(best)
        wanted -= pairs(best)
    return chosen


@pytest.mark.slow
@pytest.mark.parametrize("devices", [4, 8])
def test_every_planner_layout_trains_like_one_process(devices):
    layouts = planner_layouts(devices)
    assert len({str(lo) for lo in layouts}) == len(layouts)  # distinct
    if os.environ.get("MINITRAIN_SWEEP") != "full":
        layouts = pairwise(layouts)
    # the sweep covers what issue 26 found refused: SP with CP, uneven stages, ZeRO-3 + recompute
    assert any(lo["sequence_parallel"] and lo["cp"] > 1 for lo in layouts)
    assert any(lo["pp"] == 2 for lo in layouts)
    assert any(lo["zero"] == 3 and lo["checkpointing"] == "full" for lo in layouts)
    ref = single_process_losses(CFG, STEPS, BATCH[devices], LR, SEED, optimizer="sgd")
    results = launch(_train_every_layout, devices, layouts, BATCH[devices], timeout=600)
    bad = []
    for i, layout in enumerate(layouts):
        for rank, got in enumerate(r[i] for r in results):
            if isinstance(got, str):
                bad.append(f"{layout} rank {rank}: {got}")
                break
            delta = max(abs(a - b) for a, b in zip(got, ref))
            if delta > 1e-5:
                bad.append(f"{layout} rank {rank}: max |Δloss| = {delta:.2e}")
                break
    assert not bad, f"{len(bad)} of {len(layouts)} layouts:\n" + "\n".join(bad[:20])
    assert ref[1] < ref[0]  # and SGD with lr = 1 really trained


def test_planner_proposes_sp_only_where_tp_divides_a_cp_shard_and_no_pipeline_when_tied():
    """Sequence parallelism cuts each CP rank's seq_len / cp positions over the TP ranks:
    with 12 positions, CP2 leaves 6, which TP4 cannot cut (TP4 without SP, or TP4 + SP
    without CP, is fine). A tied head lives on the first stage: no pipeline."""
    cfg = GPTConfig(vocab_size=16, seq_len=12, n_layer=2, n_head=4, d_model=16)
    layouts = enumerate_layouts(cfg, 12, 8, 8, 8)
    assert all((12 // lo.cp) % lo.tp == 0 for lo in layouts if lo.sequence_parallel)
    assert any(lo.tp == 4 and lo.cp == 2 and not lo.sequence_parallel for lo in layouts)
    assert any(lo.tp == 4 and lo.cp == 1 and lo.sequence_parallel for lo in layouts)
    tied = GPTConfig(vocab_size=16, seq_len=12, n_layer=2, n_head=4, d_model=16, tie_weights=True)
    assert {lo.pp for lo in enumerate_layouts(tied, 12, 8, 8, 8)} == {1}
