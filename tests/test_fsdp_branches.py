"""FSDP when each rank runs its own branch (issue 40, item 2), against one process.

A trunk, then each rank's rows through its own branch only, the branch's output being the
model's output (tests/toy_models.py ``PerRankBranches``: ``nn.ModuleList`` or ``nn.ModuleDict``,
the trunk registered before or after the branches, branch sizes all different, one spare
branch no rank runs), optionally behind a root parameter needed again in backward
(``x * scale * scale``). Two failures this pins (minitrain/fsdp/gathers.py):

- branches registered before the trunk: the trunk runs first, and FSDP's ``_pre_forward``
  freed every "earlier" unit — the branches still to come — so each rank gathered its own
  branch a second time, a collective its peers did not issue: with equal branch sizes a
  gradient silently 0.24 off one process, with different sizes a gloo abort ("Received data
  size doesn't match expected size");
- the branch's backward hook fires before the model output's, which skipped FSDP's start of
  backward: the root was never gathered again ("size of tensor a (5) must match the size of
  tensor b (0)"), or, branches first, gloo aborted.

The reference is plain torch on one process: the full model, the loss the mean of the ranks'
losses, SGD. Every parameter on every rank after every step — the branches a rank never ran
and the spare one included, read with ``full_state_dict()`` — must equal it; and after each
step no unit may still hold its gathered buffer.
"""

import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from toy_models import PerRankBranches, branch_of, branches_reference, mse, toy_batch

from minitrain.runtime import launch

STEPS, LR = 3, 0.5
KINDS, TRUNK_FIRST, SCALED = ("list", "dict"), (True, False), (False, True)
# fp32: the ranks' gradients are one process's sums taken in another order (~1e-7 relative);
# a branch gathered from another rank's unit, or not reduced, is off by O(lr) = O(0.1)
TOL = 1e-5


class ScaledBranches(PerRankBranches):
    """``PerRankBranches`` behind ``x * scale * scale``: ``scale`` belongs to no unit (the
    root), and backward needs it again (each product saves it) — after the branch's hook."""

    def __init__(self, n, kind, trunk_first):
        super().__init__(n, kind, trunk_first)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 5))

    def forward(self, x, branch):
        return super().forward(x * self.scale * self.scale, branch)


def _model(kind, trunk_first, scaled, world):
    torch.manual_seed(0)
    return (ScaledBranches if scaled else PerRankBranches)(world + 1, kind, trunk_first)


def _train(cases):
    from minitrain.fsdp import FullyShardedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for case in cases:
        kind, trunk_first, scaled = case
        fsdp = FullyShardedDataParallel(_model(kind, trunk_first, scaled, world))
        opt = torch.optim.SGD(fsdp.parameters(), lr=LR)
        states, held = [], []
        for s in range(STEPS):
            x, y = toy_batch(s, rank, world)
            opt.zero_grad()
            mse(fsdp(x, branch_of(rank, trunk_first)), y).backward()
            fsdp.finish_gradient_synchronization()
            # a unit kept for a later turn in forward must be given back by the end of the step
            held += [u.name for u in fsdp.live_units() if u.full.untyped_storage().nbytes()]
            opt.step()
            states.append(fsdp.full_state_dict())  # (its gathers sit between two passes)
        out[case] = states, held
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_per_rank_branches_match_one_process(world):
    cases = list(itertools.product(KINDS, TRUNK_FIRST, SCALED))
    refs = {case: branches_reference(_model(*case, world), case[1], world, STEPS, LR)
            for case in cases}
    for (kind, trunk_first, _), states in refs.items():  # the reference is not vacuous
        start = dict(_model(kind, trunk_first, False, world).named_parameters())
        spare = world if trunk_first else 0
        unused = f"branches.{'b' if kind == 'dict' else ''}{spare}."
        for name, p in start.items():
            moved = (states[-1][name] - p).abs().max().item()
            assert (moved == 0) if name.startswith(unused) else (moved > 1e-3), (name, moved)
    for rank, per_case in enumerate(launch(_train, world, cases, timeout=120)):
        for (kind, trunk_first, scaled), (states, held) in per_case.items():
            what = (
                f"world {world}, rank {rank}, {kind} branches, trunk "
                f"{'first' if trunk_first else 'last'}{', root x * s * s' if scaled else ''}"
            )
            assert not held, f"{what}: units still gathered after a step: {held}"
            for step, (state, want) in enumerate(zip(states, refs[(kind, trunk_first, scaled)])):
                assert list(state) == list(want)
                for name, value in want.items():
                    err = (state[name] - value).abs().max().item()
                    assert err <= TOL, (
                        f"{what}, step {step}: {name} differs from one process by {err:.3g}"
                    )
