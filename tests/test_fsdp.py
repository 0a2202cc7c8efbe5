"""minitrain.fsdp.FullyShardedDataParallel against its contract (docs/design.md, Public API):
single-process references (fp32 and the same casts in bf16/fp16), torch's clip_grad_norm_,
the ZeRO-3 formulas, and the style of a public course's FSDP tests (warnings are errors)."""

import copy

import pytest
import torch
import torch.distributed as dist
from toy_models import Branchy, Toy, mse, toy_batch

from minitrain.runtime import launch

STEPS = 10


def _reference(model_cls, opt_cls, lr, steps=STEPS, world=1, dtype=None):
    """One process. With ``dtype``: fp32 masters, each step the model run in ``dtype`` on each
    of ``world`` sub-batches, gradients cast to fp32 and averaged — the casts FSDP makes.
    Low-precision matmuls round differently with another thread count (the split of the
    reduction changes), so the reference and the ranks both use one thread."""
    threads = torch.get_num_threads()
    if dtype is not None:
        torch.set_num_threads(1)
    torch.manual_seed(0)
    master = model_cls()
    opt = opt_cls(master.parameters(), lr=lr)
    for s in range(steps):
        opt.zero_grad()
        if dtype is None:
            x, y = toy_batch(s)
            mse(master(x), y).backward()
        else:
            grads = [torch.zeros_like(p) for p in master.parameters()]
            for r in range(world):
                low = copy.deepcopy(master).to(dtype)
                x, y = toy_batch(s, r, world)
                mse(low(x.to(dtype)), y).backward()
                for g, p in zip(grads, low.parameters()):
                    if p.grad is not None:
                        g += p.grad.float() / world
            for p, g in zip(master.parameters(), grads):
                p.grad = g
        opt.step()
    torch.set_num_threads(threads)
    return {n: p.detach().clone() for n, p in master.named_parameters()}


def _train_fsdp(model_cls, opt_cls, lr, steps=STEPS, compute_dtype=None, replicated=None):
    from minitrain.fsdp import FullyShardedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    if compute_dtype is not None:
        torch.set_num_threads(1)  # as the reference: see _reference
    torch.manual_seed(0)
    model = model_cls()
    rep = [p for n, p in model.named_parameters() if replicated and replicated in n]
    fsdp = FullyShardedDataParallel(model, compute_dtype=compute_dtype, replicated_params=rep or None)
    opt = opt_cls(fsdp.parameters(), lr=lr)
    for s in range(steps):
        x, y = toy_batch(s, rank, world)
        opt.zero_grad()
        mse(fsdp(x if compute_dtype is None else x.to(compute_dtype)), y).backward()
        fsdp.finish_gradient_synchronization()
        opt.step()
    shard_numel = sum(p.numel() for p in fsdp.parameters())
    return fsdp.full_state_dict(), shard_numel


def _compare(state, ref, atol, what):
    assert list(state) == list(ref), f"{what}: full_state_dict names {list(state)} != {list(ref)}"
    for name, want in ref.items():
        err = (state[name].float() - want).abs().max().item()
        assert err <= atol, f"{what}: {name} off by {err:.3g} (tolerance {atol})"


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("opt_name", ["SGD", "AdamW"])
def test_fp32_matches_one_process(world, opt_name):
    opt_cls, lr = getattr(torch.optim, opt_name), (0.1 if opt_name == "SGD" else 1e-2)
    ref = _reference(Toy, opt_cls, lr)
    for rank, (state, _) in enumerate(launch(_train_fsdp, world, Toy, opt_cls, lr, timeout=180)):
        _compare(state, ref, 2e-6, f"{opt_name} world {world} rank {rank}")


def test_parameters_are_this_ranks_shards():
    psi = sum(p.numel() for p in Toy().parameters())
    for world in (2, 3):
        shards = [n for _, n in launch(_train_fsdp, world, Toy, torch.optim.SGD, 0.1, 1, timeout=120)]
        # each unit padded to a multiple of N: a shard is ceil(unit/N), in total at most
        # psi/N + one element per unit
        for n in shards:
            assert psi / world <= n <= psi / world + 8, f"world {world}: a rank holds {n} of {psi}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_matches_one_process_doing_the_same_casts(dtype):
    world = 2
    ref = _reference(Toy, torch.optim.SGD, 0.1, world=world, dtype=dtype)
    for rank, (state, _) in enumerate(
        launch(_train_fsdp, world, Toy, torch.optim.SGD, 0.1, compute_dtype=dtype, timeout=180)
    ):
        # the same casts in the same order; what differs is the fp32 sum of the two ranks'
        # gradients (reduce-scatter vs a Python loop): a few fp32 ulps per step
        _compare(state, ref, 1e-5, f"{dtype} rank {rank}")


def test_unused_parameters_and_replicated_params_match_one_process():
    ref = _reference(Branchy, torch.optim.AdamW, 1e-2)
    for world in (2, 3):
        for replicated in (None, "inp"):
            results = launch(
                _train_fsdp, world, Branchy, torch.optim.AdamW, 1e-2, replicated=replicated,
                timeout=180,
            )
            for rank, (state, _) in enumerate(results):
                _compare(state, ref, 2e-6, f"world {world} replicated={replicated} rank {rank}")
                assert torch.equal(state["never.weight"], ref["never.weight"])


def _clip(max_norm):
    from minitrain.fsdp import FullyShardedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    fsdp = FullyShardedDataParallel(Toy())
    x, y = toy_batch(0, rank, world)
    mse(fsdp(x), y).backward()
    fsdp.finish_gradient_synchronization()
    norm = fsdp.clip_grad_norm_(max_norm)
    torch.optim.SGD(fsdp.parameters(), lr=0.1).step()
    return float(norm), fsdp.full_state_dict()


def test_clip_grad_norm_equals_torch_on_the_full_model():
    torch.manual_seed(0)
    model = Toy()
    x, y = toy_batch(0)
    mse(model(x), y).backward()
    want = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    for norm, state in launch(_clip, 3, 0.05, timeout=120):
        assert abs(norm - want) <= 1e-6 * want, f"total norm {norm}, torch says {want}"
        _compare(state, dict(model.named_parameters()), 1e-6, "after clipping")


def _no_warnings(compute_dtype):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as public courses' FSDP tests run it
        state, _ = _train_fsdp(Toy, torch.optim.AdamW, 1e-3, 3, compute_dtype)
    return sorted(state)


def test_runs_without_warnings():
    for dtype in (None, torch.float16):
        names = launch(_no_warnings, 2, dtype, timeout=120)[0]
        assert names == sorted(n for n, _ in Toy().named_parameters())
