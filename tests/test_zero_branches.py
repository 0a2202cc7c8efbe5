"""ZeRO stages 1-3 when each rank runs its own branch (issue 40, item 2), against one process.

A trunk, then each rank's rows through its own branch only, the branch's output being the
model's output (tests/toy_models.py ``PerRankBranches``: ``nn.ModuleList`` or ``nn.ModuleDict``,
the trunk registered before or after the branches, branch sizes all different, one spare
branch no rank runs). Stage 3 aborted in gloo ("Received data size doesn't match expected
size"): the branch's backward hook fired before the model output's, so each rank gathered its
own branch first, outside the one unit order all ranks follow; and with the trunk registered
last, the rank whose branch comes just before it prefetched the trunk again after running it
(minitrain/zero/gather_order.py). The reference is plain torch on one process: the full
model, the loss the mean of the ranks' losses, SGD. Every parameter on every rank after every
step — the branches a rank never ran and the spare one included, read with
``full_state_dict()`` — must equal it.
"""

import itertools

import pytest
import torch
import torch.distributed as dist
from toy_models import PerRankBranches, branch_of, branches_reference, mse, toy_batch

from minitrain.runtime import launch

STEPS, LR = 3, 0.5
STAGES, KINDS, TRUNK_FIRST = (1, 2, 3), ("list", "dict"), (True, False)
# fp32: the ranks' gradients are one process's sums taken in another order (~1e-7 relative);
# a branch gathered from another rank's unit, or not reduced, is off by O(lr) = O(0.1)
TOL = 1e-5


def _model(kind, trunk_first, world):
    torch.manual_seed(0)
    return PerRankBranches(world + 1, kind, trunk_first)


def _train(cases):
    from minitrain.zero import ZeroDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage, kind, trunk_first in cases:
        zdp = ZeroDataParallel(_model(kind, trunk_first, world), torch.optim.SGD, stage, lr=LR)
        states = []
        for s in range(STEPS):
            x, y = toy_batch(s, rank, world)
            zdp.zero_grad()
            mse(zdp(x, branch_of(rank, trunk_first)), y).backward()
            zdp.step()
            states.append(zdp.full_state_dict())  # (its gathers sit between two passes)
        out[(stage, kind, trunk_first)] = states
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_per_rank_branches_match_one_process(world):
    refs = {(k, t): branches_reference(_model(k, t, world), t, world, STEPS, LR)
            for k in KINDS for t in TRUNK_FIRST}
    for (kind, trunk_first), states in refs.items():  # the reference is not vacuous
        start = dict(_model(kind, trunk_first, world).named_parameters())
        spare = world if trunk_first else 0
        unused = f"branches.{'b' if kind == 'dict' else ''}{spare}."
        for name, p in start.items():
            moved = (states[-1][name] - p).abs().max().item()
            assert (moved == 0) if name.startswith(unused) else (moved > 1e-3), (name, moved)
    cases = list(itertools.product(STAGES, KINDS, TRUNK_FIRST))
    for rank, per_case in enumerate(launch(_train, world, cases, timeout=120)):
        for (stage, kind, trunk_first), states in per_case.items():
            for step, (state, want) in enumerate(zip(states, refs[(kind, trunk_first)])):
                assert list(state) == list(want)
                for name, value in want.items():
                    err = (state[name] - value).abs().max().item()
                    assert err <= TOL, (
                        f"stage {stage}, world {world}, rank {rank}, {kind} branches, trunk "
                        f"{'first' if trunk_first else 'last'}, step {step}: {name} differs "
                        f"from one process by {err:.3g}"
                    )
