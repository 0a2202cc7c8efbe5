"""FSDP beyond the contract tests (tests/test_fsdp.py): the course's GPT with tied weights, a
public course's style of check step by step, ranks skipping different blocks, checkpoints,
clear errors, and the measured bytes and timeline against their formulas."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from toy_models import Toy, mse, toy_batch  # tests/ is on sys.path under pytest

from minitrain.runtime import LaunchError, launch

GPT_KW = dict(vocab_size=64, seq_len=16, n_layer=3, n_head=2, d_model=32, bias=False)


def _gpt(tie=False):
    from minitrain.model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(**GPT_KW, tie_weights=tie))


def _gpt_batches(steps, batch=8):
    from minitrain.data import get_batch
    from minitrain.model import lm_loss

    return [(*get_batch(s, batch, vocab_size=64, seq_len=16), lm_loss) for s in range(steps)]


def _gpt_fsdp(tie, compute_dtype, steps):
    from minitrain.fsdp import FullyShardedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    fsdp = FullyShardedDataParallel(_gpt(tie), compute_dtype=compute_dtype)
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-3)
    states = []
    for x, y, loss_fn in _gpt_batches(steps):
        b = x.shape[0] // world
        opt.zero_grad()
        loss_fn(fsdp(x[rank * b : (rank + 1) * b]), y[rank * b : (rank + 1) * b]).backward()
        fsdp.finish_gradient_synchronization()
        opt.step()
        states.append(fsdp.full_state_dict())
    return states


@pytest.mark.parametrize(
    "tie,dtype,atol", [(True, None, 1e-6), (False, None, 1e-6), (True, torch.float16, 1e-4)]
)
def test_gpt_each_step_like_a_public_course_checks_it(tie, dtype, atol):
    """Reference: a deepcopy of the model in one process (with the same casts in fp16); each
    rank a slice of the batch; full_state_dict compared after every one of 3 steps."""
    from minitrain.fsdp.measure import one_process_reference

    ref = one_process_reference(_gpt(tie), _gpt_batches(3), dtype, lr=1e-3, world=2)
    for rank, states in enumerate(launch(_gpt_fsdp, 2, tie, dtype, 3, timeout=120)):
        for step, (got, want) in enumerate(zip(states, ref)):
            assert list(got) == list(want)  # tied: the head's weight is tok_emb.weight's name
            for name in want:
                assert got[name].dtype == torch.float32, f"{name} is {got[name].dtype}, not fp32"
                torch.testing.assert_close(
                    got[name], want[name], atol=atol, rtol=1e-4,
                    msg=lambda m, n=name, s=step, r=rank: f"rank {r} step {s} {n}: {m}",
                )  # fmt: skip


class Skippy(nn.Module):
    """Four blocks; blocks 1 and 2 run only when the batch's first feature has a positive
    mean: ranks holding different data skip different blocks (two in a row)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.blocks = nn.ModuleList(nn.Linear(7, 7) for _ in range(4))
        self.out = nn.Linear(7, 3)

    def forward(self, x):
        h = self.inp(x)
        for i, b in enumerate(self.blocks):
            if i in (1, 2) and x[:, 0].mean() <= 0:
                continue
            h = torch.tanh(b(h))
        return self.out(h)


def _skippy_fsdp(steps):
    from minitrain.fsdp import FullyShardedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    fsdp = FullyShardedDataParallel(Skippy())
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    skipped = []
    for s in range(steps):
        x, y = toy_batch(s, rank, world)
        x[:, 0] += 1.0 if rank == 0 else -1.0  # rank 0 runs every block, rank 1 skips two
        skipped.append(bool(x[:, 0].mean() <= 0))
        opt.zero_grad()
        mse(fsdp(x), y).backward()
        opt.step()  # (finish_gradient_synchronization ran by itself at the end of backward)
    return fsdp.full_state_dict(), skipped


def test_ranks_skipping_different_blocks_match_one_process():
    torch.manual_seed(0)
    model, world, steps = Skippy(), 2, 4
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(steps):
        opt.zero_grad()
        loss = 0.0
        for r in range(world):  # the mean of the ranks' losses: what averaged gradients descend
            x, y = toy_batch(s, r, world)
            x[:, 0] += 1.0 if r == 0 else -1.0
            loss = loss + mse(model(x), y) / world
        loss.backward()
        opt.step()
    results = launch(_skippy_fsdp, world, steps, timeout=120)
    assert all(results[1][1]) and not any(results[0][1]), "the test lost its skipping ranks"
    for rank, (state, _) in enumerate(results):
        for name, want in model.named_parameters():
            err = (state[name] - want).abs().max().item()
            assert err <= 2e-6, f"rank {rank}: {name} off by {err:.3g}"


def _checkpointed(steps, save_dir=None, save_at=(), load=None, dtype=None):
    from minitrain.fsdp import FullyShardedDataParallel
    from minitrain.zero import load_checkpoint, save_checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(123)  # another init: loading must overwrite all of it
    fsdp = FullyShardedDataParallel(Toy(), compute_dtype=dtype)
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
    start = load_checkpoint(fsdp, load, optimizer=opt)["step"] if load else 0
    for s in range(start, steps):
        x, y = toy_batch(s, rank, world)
        opt.zero_grad()
        mse(fsdp(x), y).backward()
        opt.step()
        if s + 1 in save_at:
            save_checkpoint(fsdp, save_dir, s + 1, extra={"step": s + 1}, optimizer=opt)
    return fsdp.full_state_dict()


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_checkpoint_resume_is_bit_exact_and_reshards(tmp_path, dtype):
    whole = launch(_checkpointed, 2, 6, dtype=dtype, timeout=120)
    launch(_checkpointed, 2, 3, str(tmp_path), (3,), dtype=dtype, timeout=120)
    ckpt = os.path.join(tmp_path, "step_00000003")
    resumed = launch(_checkpointed, 2, 6, load=ckpt, dtype=dtype, timeout=120)
    for rank in range(2):
        for name, want in whole[rank].items():
            assert torch.equal(resumed[rank][name], want), f"rank {rank}: {name} not bit-exact"
    if dtype is None:  # 2 → 3 ranks: same state, continued with another summation order
        resharded = launch(_checkpointed, 3, 6, load=ckpt, timeout=120)[0]
        for name, want in whole[0].items():
            err = (resharded[name] - want).abs().max().item()
            assert err <= 2e-6, f"{name} after resharding 2 → 3 ranks off by {err:.3g}"


def _construct(kind):
    from minitrain.fsdp import FullyShardedDataParallel

    model = Toy()
    if kind == "int dtype":
        FullyShardedDataParallel(model, compute_dtype=torch.int32)
    elif kind == "string dtype":
        FullyShardedDataParallel(model, compute_dtype="bf16")
    elif kind == "foreign param":
        FullyShardedDataParallel(model, replicated_params=[nn.Parameter(torch.zeros(4, 2))])


@pytest.mark.parametrize(
    "kind,message",
    [
        ("int dtype", r"compute_dtype .* got torch\.int32"),
        ("string dtype", r"compute_dtype .* got 'bf16'"),
        ("foreign param", r"replicated_params\[0\] \(a tensor of shape \(4, 2\)\) is not"),
    ],
)
def test_bad_arguments_are_named(kind, message):
    with pytest.raises(LaunchError, match=message):
        launch(_construct, 1, kind, timeout=60)


def _measured(dtype):
    from minitrain.data import get_batch
    from minitrain.fsdp import FullyShardedDataParallel
    from minitrain.fsdp.measure import gpt_step_report
    from minitrain.runtime import trace

    rank, world = dist.get_rank(), dist.get_world_size()
    fsdp = FullyShardedDataParallel(_gpt(), compute_dtype=dtype)
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-3)
    assert {id(p) for p in fsdp.parameters()} == {id(u.master) for u in fsdp.live_units()}
    x, y = get_batch(0, 6, rank, world, vocab_size=64, seq_len=16)
    gpt_step_report(fsdp, opt, x, y)  # the first step creates AdamW's state
    trace.reset()
    report = gpt_step_report(fsdp, opt, x, y)
    return report, trace.events()


@pytest.mark.parametrize("world,dtype", [(2, None), (3, None), (2, torch.bfloat16)])
def test_bytes_peak_and_communication_equal_their_formulas(world, dtype):
    from minitrain.zero import communication_formula, memory_formula

    for report, _ in launch(_measured, world, dtype, timeout=120):
        psi, formula = report["padded_numel"], report["formula"]
        for part in ("params", "grads", "optimizer", "total"):
            assert report["bytes"][part] == formula[part], (part, report["bytes"], formula)
        if dtype is None:  # fp32: exactly ZeRO-3's 16Ψ/N and 3Ψ·(N-1)/N
            assert report["bytes"]["total"] == memory_formula(psi, world, 3)["total"]
            assert report["sent"]["total"] == communication_formula(psi, world, 3)
        else:  # the two gathers in 2 bytes, the reduce-scatter in 4
            assert report["sent"]["all_gather"] == 2 * 2 * psi * (world - 1) / world
            assert report["sent"]["reduce_scatter"] == 4 * psi * (world - 1) / world
        assert report["sent"]["total"] == formula["sent"]
        assert report["peak_gathered"] == report["predicted_peak"] < report["model_bytes"]


def test_timeline_shows_prefetch_and_reduce_scatter_overlapping_compute():
    _, events = launch(_measured, 2, None, timeout=120)[0]
    first = {}
    for e in events:
        first.setdefault(e.name, e)
    # block 1's gather is launched as block 0 starts computing, before block 0 ends
    assert first["gather block 1"].start < first["forward block 0"].end
    # the last block's gradients leave while earlier blocks still run their backward
    assert first["reduce-scatter block 2"].start < first["backward block 0"].end
    assert first["gather block 1"].start < first["backward block 2"].start  # (forward first)


def test_zero_grad_by_the_optimizer_and_accumulation():
    """Two backward passes before a step add up in the shards' .grad, as in one process."""
    torch.manual_seed(0)
    model = Toy()
    for s in range(2):
        mse(model(toy_batch(s)[0]), toy_batch(s)[1]).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    got = launch(_accumulate, 2, timeout=60)[0]
    for name in want:
        assert (got[name] - want[name]).abs().max() <= 1e-6, name


def _accumulate():
    from minitrain.fsdp import FullyShardedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    fsdp = FullyShardedDataParallel(Toy())
    for s in range(2):
        x, y = toy_batch(s, rank, world)
        mse(fsdp(x), y).backward()
    # the gradients, put where the parameters are and gathered like them
    saved = [u.master.detach().clone() for u in fsdp.live_units()]
    with torch.no_grad():
        for u in fsdp.live_units():
            u.master.copy_(u.master.grad)
    grads = fsdp.full_state_dict()
    with torch.no_grad():
        for u, s in zip(fsdp.live_units(), saved):
            u.master.copy_(s)
    return grads


def test_deepcopy_reference_is_independent():
    """(The helper used above does not train the caller's model.)"""
    from minitrain.fsdp.measure import one_process_reference

    m = Toy()
    before = copy.deepcopy(m.state_dict())
    one_process_reference(m, [(toy_batch(0)[0], toy_batch(0)[1], mse)])
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())


def _clip_replicated():
    from minitrain.fsdp import FullyShardedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Toy()
    fsdp = FullyShardedDataParallel(model, replicated_params=list(model.out.parameters()))
    x, y = toy_batch(0, rank, world)
    mse(fsdp(x), y).backward()
    return float(fsdp.clip_grad_norm_(0.05)), fsdp.full_state_dict()


def test_clip_with_replicated_params_equals_torch():
    """Replicated gradients are whole on every rank: counted once in the norm, not N times."""
    torch.manual_seed(0)
    model = Toy()
    mse(model(toy_batch(0)[0]), toy_batch(0)[1]).backward()
    want = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
    for norm, _ in launch(_clip_replicated, 3, timeout=60):
        assert abs(norm - want) <= 1e-6 * want, f"total norm {norm}, torch says {want}"


def _evaluate():
    from minitrain.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    fsdp = FullyShardedDataParallel(Toy(), compute_dtype=None)
    with torch.no_grad():
        out = fsdp(toy_batch(0)[0])
    held = [u.full.untyped_storage().nbytes() for u in fsdp.units if u is not None]
    return out, held


def test_evaluation_under_no_grad_gathers_and_frees():
    torch.manual_seed(0)
    want = Toy()(toy_batch(0)[0])
    for out, held in launch(_evaluate, 2, timeout=60):
        assert torch.allclose(out, want, atol=1e-6), (out - want).abs().max()
        assert held == [0] * len(held), f"units still gathered after an evaluation: {held}"
