"""Chapter 5 bug hunt (minitrain.course.bughunts): fp16 ZeRO with a loss scaler, an overflow
in one rank's shard only. Reference: torch.amp.GradScaler driven by the same overflow
pattern — every rank must skip exactly those steps and follow its scale, and the ranks must
stay one model (the same full weights on every rank)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from minitrain.runtime import launch

OVERFLOW_STEPS, STEPS, INIT_SCALE, GROWTH = (1, 3), 5, 2.0**10, 2


def _fp16_zero():
    from minitrain.precision import DynamicLossScaler
    from minitrain.zero import ZeroDataParallel

    rank = dist.get_rank()
    torch.manual_seed(0)
    scaler = DynamicLossScaler(init_scale=INIT_SCALE, growth_interval=GROWTH)
    # the last weight column lands in rank 1's shard: only rank 1 sees the overflow
    z = ZeroDataParallel(
        nn.Linear(8, 1), torch.optim.SGD, 1, compute_dtype=torch.float16,
        loss_scaler=scaler, lr=0.01,
    )  # fmt: skip
    scales = []
    for s in range(STEPS):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(s))
        if rank == 1 and s in OVERFLOW_STEPS:
            x[:, 7] = 1e4  # fp16 gradient overflows on rank 1 only
        z.zero_grad()
        z.loss_scaler.scale(z(x).float().mean()).backward()
        z.step()
        scales.append(scaler.get_scale())
    state = {k: v.float() for k, v in z.full_state_dict().items()}
    return scales, state


def _grad_scaler_scales():
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH)
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    scales = []
    for s in range(STEPS):
        scaler.scale(torch.ones(()))
        p.grad = torch.full((1,), float("inf") if s in OVERFLOW_STEPS else 1.0)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.exercise("bug hunt: ZeroDataParallel._scaled_step", points=2)
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    want = _grad_scaler_scales()
    (scales0, state0), (scales1, state1) = launch(_fp16_zero, 2, timeout=90)
    for rank, scales in enumerate((scales0, scales1)):
        assert scales == want, (
            f"rank {rank}: loss scales {scales} over {STEPS} steps; torch.amp.GradScaler gives "
            f"{want} (overflow on rank 1 at steps {list(OVERFLOW_STEPS)})"
        )
    drift = max((state0[k] - state1[k]).abs().max().item() for k in state0)
    assert drift == 0, f"ranks 0 and 1 hold different weights (by {drift:.3g}): no longer one model"
