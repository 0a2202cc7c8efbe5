"""Techniques compose (issue 12): data parallelism when ranks use different parameters, and
mixed precision under DDP and ZeRO.

- ZeRO stages 1-3 whose ranks take different data-dependent branches (a parameter used by one
  rank only, one used by none) against one process on the mean of every rank's loss;
- DataParallel's gradients against torch's DistributedDataParallel(find_unused_parameters=True),
  ``None`` exactly where torch leaves ``None``;
- bf16 MasterWeightOptimizer under DataParallel, and ZeroDataParallel(compute_dtype=bf16),
  against a hand-written fp32-master loop on one process;
- fp16 ZeRO with a DynamicLossScaler: an overflow on one rank skips the step on every rank, and
  the scale follows torch.amp.GradScaler's sequence; bf16 bytes per parameter per stage.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from minitrain.runtime import launch
from minitrain.zero import memory_formula

H = 6  # hidden width of the branchy model


# --------------------------------------------------------------------------- models
class _Fork(nn.Module):
    """Rows whose ``route`` is true go through ``even``, the others through ``odd``; ``never``
    (if any) is never used. The block itself always runs (stage 3 gathers it), its parameters
    may not: so a block is complete early on some ranks and only at the end on others."""

    def __init__(self, h, never):
        super().__init__()
        self.even, self.odd = nn.Linear(h, h), nn.Linear(h, h)
        self.never = nn.Linear(h, h) if never else None

    def forward(self, h, route):
        out = torch.zeros_like(h)
        if route.any():
            out[route] = torch.tanh(self.even(h[route]))
        if (~route).any():
            out[~route] = torch.tanh(self.odd(h[~route]))
        return h + out


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, H)
        # block 0 holds a never-used layer; blocks 1 and 2 can be complete on one rank only
        self.blocks = nn.ModuleList([_Fork(H, True), _Fork(H, False), _Fork(H, False)])
        self.out = nn.Linear(H, 2)

    def forward(self, x):
        route = x[:, 0] > 0  # decided by the data: ranks with other data use other layers
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, route)
        return self.out(h)


def _rank_batch(step, rank, world, rows=2):
    """Rank ``step % world`` sends one row through ``even`` and one through ``odd``, every
    other rank sends all rows through ``odd``: each step ``even`` is used by exactly one rank,
    and that rank alone completes blocks 2 and 1 during backward (block 0 has ``never``): its
    reduce-scatters would come before stage 3's backward gathers, the other ranks' after."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(rows, 4, generator=g), torch.randn(rows, 2, generator=g)
    sign = torch.full((rows,), -1.0)
    if rank == step % world:
        sign[0] = 1.0
    x[:, 0] = sign * (x[:, 0].abs() + 0.1)
    return x, y


def _mse(out, y):
    return ((out.float() - y) ** 2).mean()


# --------------------------------------------------------------------------- ZeRO, different parameters
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2)),
}
STEPS = 3


def _zero_reference(world, opt_name, steps=STEPS):
    """One process on the mean of every rank's loss. A parameter no rank used gets a zero
    gradient, as ZeRO's flat shards give it (AdamW's weight decay then still moves it)."""
    cls, kw = OPTIMIZERS[opt_name]
    torch.manual_seed(0)
    model = _Branchy()
    opt = cls(model.parameters(), **kw)
    for s in range(steps):
        opt.zero_grad()
        loss = sum(_mse(model(x), y) for x, y in (_rank_batch(s, r, world) for r in range(world)))
        (loss / world).backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _zero_branchy(cases):
    from minitrain.zero import ZeroDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage, cap, opt_name in cases:
        cls, kw = OPTIMIZERS[opt_name]
        torch.manual_seed(0)
        z = ZeroDataParallel(_Branchy(), cls, stage, bucket_cap_mb=cap, **kw)
        for s in range(STEPS):
            x, y = _rank_batch(s, rank, world)
            z.zero_grad()
            _mse(z(x), y).backward()
            z.step()
        out[(stage, cap, opt_name)] = z.full_state_dict()
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [2, 3])
def test_zero_ranks_using_different_parameters_match_one_process(world, stage):
    # one bucket, and a bucket per parameter (stages 1-2; stage 3's units are blocks)
    caps = (25.0, 0.0) if stage < 3 else (25.0,)
    cases = [(stage, cap, opt) for cap in caps for opt in OPTIMIZERS]
    refs = {opt: _zero_reference(world, opt) for opt in OPTIMIZERS}
    moved = max((refs["sgd"][n] - p).abs().max().item() for n, p in _Branchy().named_parameters())
    assert moved > 1e-3
    for rank, res in enumerate(launch(_zero_branchy, world, cases, timeout=60)):
        for (stage, cap, opt), state in res.items():
            for name, want in refs[opt].items():
                err = (state[name] - want).abs().max().item()
                assert err <= 1e-5, (
                    f"stage {stage}, bucket_cap_mb={cap}, {opt}, world {world}, rank {rank}: "
                    f"{name} differs from one process by {err:.3g}"
                )


# --------------------------------------------------------------------------- DDP, unused parameters
def _ddp_grads(communication):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from minitrain.ddp import DataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ours = DataParallel(_Branchy(), bucket_cap_mb=0.0, communication=communication)
    torch.manual_seed(0)
    theirs = DDP(_Branchy(), find_unused_parameters=True)
    records = []
    for step in range(4):
        x, y = _rank_batch(step, rank, world)
        if step == 3:  # every rank takes the odd branch: "even" is used by nobody this time
            x[:, 0] = -x[:, 0].abs() - 0.1
        grads = []
        for m in (ours, theirs):
            if step != 2:  # step 2 keeps last step's .grad tensors (zero_grad(set_to_none=False))
                m.zero_grad(set_to_none=True)
            else:
                m.zero_grad(set_to_none=False)
            _mse(m(x), y).backward()
            grads.append({n.removeprefix("module."): p.grad for n, p in m.named_parameters()})
        records.append(
            {
                n: (
                    grads[0][n] is None,
                    grads[1][n] is None,
                    0.0
                    if grads[0][n] is None or grads[1][n] is None
                    else (grads[0][n] - grads[1][n]).abs().max().item(),
                )
                for n in grads[1]
            }
        )
    return records


@pytest.mark.parametrize("world,communication", [(2, "torch"), (3, "torch"), (2, "ring")])
def test_ddp_unused_parameters_match_torch_ddp(world, communication):
    for rank, records in enumerate(launch(_ddp_grads, world, communication, timeout=120)):
        for step, rec in enumerate(records):
            assert rec["blocks.0.never.weight"][1], "torch must leave the never-used grad None"
            for name, (ours_none, torch_none, err) in rec.items():
                where = f"rank {rank}, step {step}, {name}"
                assert ours_none == torch_none, (
                    f"{where}: .grad is None is {ours_none}, torch DDP gives {torch_none}"
                )
                assert err < 1e-6, f"{where}: gradient differs from torch DDP by {err:.3g}"


# --------------------------------------------------------------------------- bf16 master weights
class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


BF16_STEPS, BF16_LR, GLOBAL_ROWS = 4, 0.05, 8


def _bf16_batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_ROWS, 4, generator=g), torch.randn(GLOBAL_ROWS, 2, generator=g)


def _fp32_master_reference():
    """By hand, one process: bf16 model on the full batch, fp32 master update, copy back."""
    torch.manual_seed(0)
    model = _Toy()
    masters = [p.detach().clone() for p in model.parameters()]  # from the fp32 weights
    model.to(torch.bfloat16)
    opt = torch.optim.SGD(masters, lr=BF16_LR)
    for s in range(BF16_STEPS):
        x, y = _bf16_batch(s)
        model.zero_grad()
        _mse(model(x.to(torch.bfloat16)), y).backward()
        for p, m in zip(model.parameters(), masters):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)
    names = [n for n, _ in model.named_parameters()]
    return dict(zip(names, masters)), {n: p.detach().clone() for n, p in model.named_parameters()}


def _rows(rank, world):
    b = GLOBAL_ROWS // world
    return slice(rank * b, (rank + 1) * b)


def _master_under_ddp():
    from minitrain.ddp import DataParallel
    from minitrain.precision import DynamicLossScaler, MasterWeightOptimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _Toy().to(torch.bfloat16)
    with torch.no_grad():  # the masters must start from the fp32 weights, as the reference's
        torch.manual_seed(0)
        fp32 = _Toy()
    ddp = DataParallel(model, bucket_cap_mb=0.0)
    opt = MasterWeightOptimizer(ddp, torch.optim.SGD, lr=BF16_LR)
    with torch.no_grad():
        for m, p in zip(opt.master_params, fp32.parameters()):
            m.copy_(p)
    scaler = DynamicLossScaler()  # chapter 2's recipe, as written
    for s in range(BF16_STEPS):
        x, y = _bf16_batch(s)
        rows = _rows(rank, world)
        opt.zero_grad()
        scaler.scale(_mse(ddp(x[rows].to(torch.bfloat16)), y[rows])).backward()
        scaler.step(opt)
        scaler.update()
    names = [n for n, _ in model.named_parameters()]
    return (
        dict(zip(names, [m.detach().clone() for m in opt.master_params])),
        {n: p.detach().clone() for n, p in model.named_parameters()},
    )


def _zero_bf16(stages):
    from minitrain.zero import ZeroDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in stages:
        torch.manual_seed(0)
        z = ZeroDataParallel(
            _Toy(), torch.optim.SGD, stage, bucket_cap_mb=0.0, compute_dtype=torch.bfloat16,
            lr=BF16_LR,
        )
        for s in range(BF16_STEPS):
            x, y = _bf16_batch(s)
            rows = _rows(rank, world)
            z.zero_grad()
            _mse(z(x[rows]), y[rows]).backward()
            z.step()
        assert all(p.dtype == torch.bfloat16 for p in z.module.parameters())
        assert all(u.master.dtype == torch.float32 for u in z.live_units())
        out[stage] = z.full_state_dict()
    return out


# The data-parallel gradient is the same sum as the reference's in another order, each rank's
# part rounded to bf16 (8 significant bits): relative error ~2^-8 of a gradient. Times lr and
# 4 steps that is ~1e-3 of the gradients' size; the masters may differ by that, the bf16 weights
# by it or one bf16 ulp (2^-8 relative: < 4e-3 for weights below 1). A master that stepped on one
# rank's gradient instead of the average is off by ~lr·|g| ≈ 1e-2.
MASTER_ATOL, WEIGHT_ATOL = 1e-3, 8e-3


@pytest.mark.parametrize("world", [2, 4])
def test_master_weights_under_ddp_match_fp32_master_loop(world):
    ref_masters, ref_weights = _fp32_master_reference()
    for rank, (masters, weights) in enumerate(launch(_master_under_ddp, world, timeout=120)):
        for name in ref_masters:
            err = (masters[name] - ref_masters[name]).abs().max().item()
            assert err <= MASTER_ATOL, f"world {world}, rank {rank}: master {name} off by {err:.3g}"
            err = (weights[name].float() - ref_weights[name].float()).abs().max().item()
            assert err <= WEIGHT_ATOL, f"world {world}, rank {rank}: bf16 {name} off by {err:.3g}"


def test_zero_bf16_stages_match_fp32_master_loop():
    _, ref_weights = _fp32_master_reference()
    for rank, res in enumerate(launch(_zero_bf16, 2, (1, 2, 3), timeout=120)):
        for stage, state in res.items():
            for name, want in ref_weights.items():
                assert state[name].dtype == torch.bfloat16
                err = (state[name].float() - want.float()).abs().max().item()
                assert err <= WEIGHT_ATOL, f"stage {stage}, rank {rank}: {name} off by {err:.3g}"


# --------------------------------------------------------------------------- fp16 loss scaling
OVERFLOW_STEPS = (1, 4, 5)  # rank 1's input is huge on these steps only
SCALER_STEPS, INIT_SCALE, GROWTH_INTERVAL = 8, 2.0**10, 2


def _fp16_scaled(stage):
    from minitrain.precision import DynamicLossScaler
    from minitrain.zero import ZeroDataParallel

    rank = dist.get_rank()
    torch.manual_seed(0)
    scaler = DynamicLossScaler(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    # weight (8) then bias: the last weight column lands in rank 1's shard, so only rank 1's
    # shard of the gradient overflows — rank 0 alone would see nothing wrong
    z = ZeroDataParallel(
        nn.Linear(8, 1), torch.optim.SGD, stage, compute_dtype=torch.float16,
        loss_scaler=scaler, lr=0.01,
    )
    scales, changed = [], []
    for s in range(SCALER_STEPS):
        g = torch.Generator().manual_seed(s)
        x = torch.randn(2, 8, generator=g)
        if rank == 1 and s in OVERFLOW_STEPS:
            x[:, 7] = 1e4  # grad of weight[0, 7] = S/2 · Σ x ≈ 1e7: inf in fp16
        before = z.full_state_dict()
        z.zero_grad()
        z.loss_scaler.scale(z(x).float().mean()).backward()
        z.step()
        after = z.full_state_dict()
        changed.append(any(not torch.equal(before[n], after[n]) for n in after))
        scales.append(scaler.get_scale())
    masters = torch.cat([u.master.detach().reshape(-1) for u in z.live_units()])
    return scales, changed, torch.isfinite(masters).all().item()


def _grad_scaler_scales():
    """torch.amp.GradScaler (the oracle) driven by the same overflow pattern."""
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    scales = []
    for s in range(SCALER_STEPS):
        scaler.scale(torch.ones(()))  # (GradScaler sets up its scale on the first scale())
        p.grad = torch.full((1,), float("inf") if s in OVERFLOW_STEPS else 1.0)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_fp16_overflow_on_one_rank_skips_everywhere(stage):
    want = _grad_scaler_scales()
    for rank, (scales, changed, finite) in enumerate(launch(_fp16_scaled, 2, stage, timeout=120)):
        assert scales == want, f"stage {stage}, rank {rank}: scales {scales}, GradScaler {want}"
        assert changed == [s not in OVERFLOW_STEPS for s in range(SCALER_STEPS)], (
            f"stage {stage}, rank {rank}: weights changed at steps {changed} — an overflow on "
            f"rank 1 at steps {OVERFLOW_STEPS} must skip the step on every rank"
        )
        assert finite, f"stage {stage}, rank {rank}: inf/NaN reached the master weights"


# --------------------------------------------------------------------------- bf16 bytes
def _bf16_memory():
    from minitrain.zero import ZeroDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        z = ZeroDataParallel(
            _Toy(), torch.optim.AdamW, stage, bucket_cap_mb=1e-4, compute_dtype=torch.bfloat16,
            lr=1e-3,
        )
        x, y = _bf16_batch(0)
        rows = _rows(rank, world)
        z.zero_grad()
        _mse(z(x[rows]), y[rows]).backward()
        z.step()
        out[stage] = (z.memory_bytes(), z.padded_numel())
    return out


def test_zero_bf16_bytes_per_parameter_match_the_papers_formula():
    world = 2
    for stage, (mem, padded) in launch(_bf16_memory, world, timeout=60)[1].items():
        f = memory_formula(padded, world, stage, precision="mixed")  # 2 + 2 + 12 bytes
        assert mem["params"] == f["params"], (stage, mem, f)
        assert mem["optimizer"] == f["optimizer"], (stage, mem, f)  # fp32 master + moments
        # stage 1 keeps the paper's bf16 gradients (2Ψ); stages 2-3 keep the averaged gradient
        # shard in fp32 (4Ψ/N, where gradient accumulation happens), not the paper's 2Ψ/N
        want_grads = f["grads"] if stage == 1 else 2 * f["grads"]
        assert mem["grads"] == want_grads, (stage, mem, f)
