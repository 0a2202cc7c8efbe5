"""minitrain.zero against independent references: single-process AdamW on the full batch
(stages 1-3, world 2/3/4, sizes that don't divide N, offload, the GPT), the ZeRO paper's
Figure 1 numbers, exact memory formulas (with the padding), ring communication volumes,
brute-force optimal partitions, and stage 3's gather/free/prefetch order in the trace."""

import itertools

import pytest
import torch
import torch.distributed as dist
from toy_models import Toy, toy_batch

from minitrain.runtime import launch
from minitrain.zero import communication_formula, memory_formula, partition_parameters

STEPS, LR = 10, 1e-2
# Tolerance: every rank's gradient is the same sum as one process's, in a different order
# (per-rank means, then a reduce-scatter): fp32 rounding, ~1e-7 relative. AdamW's update is
# lr·m/(√v+ε), a ratio insensitive to a common relative error, so after 10 steps the
# parameters differ by a few ulp of lr-sized updates. 2e-6 is ~20 ulp of the values (≤1):
# far below one wrong step (lr = 1e-2).
ATOL = 2e-6


def _reference(steps=STEPS):
    torch.manual_seed(0)
    model = Toy()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for s in range(steps):
        x, y = toy_batch(s)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_zero(stages, offload=False, steps=STEPS, cap=4e-4):
    from minitrain.zero import ZeroDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in stages:
        torch.manual_seed(0)
        z = ZeroDataParallel(
            Toy(), torch.optim.AdamW, stage, lr=LR, offload=offload, bucket_cap_mb=cap
        )
        for s in range(steps):
            x, y = toy_batch(s, rank, world)
            z.zero_grad()
            ((z(x) - y) ** 2).mean().backward()
            z.step()
        devices = {str(t.device) for st in z.optimizer.state.values() for t in st.values()}
        out[stage] = (z.full_state_dict(), devices)
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_stages_match_single_process_adamw(world):
    ref = _reference()
    results = launch(_train_zero, world, (1, 2, 3), timeout=120)
    for rank, per_stage in enumerate(results):
        for stage, (state, _) in per_stage.items():
            assert list(state) == list(ref), "full_state_dict names differ from the module's"
            for name, want in ref.items():
                err = (state[name] - want).abs().max().item()
                assert err <= ATOL, (
                    f"stage {stage}, world {world}, rank {rank}: {name} off by {err}"
                )


def test_offload_matches_and_keeps_optimizer_state_on_the_host():
    ref = _reference()
    for state, devices in launch(_train_zero, 2, (2, 3), offload=True, timeout=120)[0].values():
        assert devices == {"cpu"}
        for name, want in ref.items():
            assert (state[name] - want).abs().max().item() <= ATOL, name


def _gpt_case(stage):
    from minitrain.data import MarkovChainData
    from minitrain.model import GPT, GPTConfig, lm_loss
    from minitrain.zero import ZeroDataParallel

    data = MarkovChainData(vocab_size=32, seq_len=8)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    torch.manual_seed(0)
    # bias=False: the key projection's bias has a gradient that is exactly 0 in exact arithmetic
    # (softmax ignores a shift shared by all scores of a query), so in fp32 it is rounding noise,
    # which Adam's m/√v normalises to lr-sized steps of random sign: no tolerance fits it
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16, bias=False))
    if world == 1:
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
    else:
        model = ZeroDataParallel(model, torch.optim.AdamW, stage, lr=LR, bucket_cap_mb=0.01)
        opt = model
    for s in range(5):
        x, y = data.get_batch(s, 8, rank, world)
        opt.zero_grad()
        lm_loss(model(x), y).backward()
        opt.step()
    return model.full_state_dict() if world > 1 else dict(model.named_parameters())


@pytest.mark.parametrize("stage", [2, 3])
def test_gpt_matches_single_process(stage):
    ref = _gpt_case(stage)
    got = launch(_gpt_case, 2, stage, timeout=120)[1]
    for name, want in ref.items():
        err = (got[name] - want.detach()).abs().max().item()
        assert err <= 1e-5, f"stage {stage}: {name} off by {err}"  # looser: 5 larger sums


# ------------------------------------------------------------------ ShardedOptimizer (ZeRO-1)
def _sharded_case():
    from minitrain.zero import ShardedOptimizer, bytes_sent, reset_bytes_sent

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Toy()
    params = list(model.parameters())
    opt = ShardedOptimizer(params[:4], torch.optim.AdamW, lr=LR)
    opt.add_param_group({"params": params[4:]})
    reset_bytes_sent()
    for s in range(STEPS):
        x, y = toy_batch(s, rank, world)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        for p in params:  # the averaging DDP would do (torch's all_reduce, the oracle)
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
    held = [i for i, p in enumerate(params) if p in opt.optimizer.state]
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    bad = dict(sd, world_size=world + 1)
    with pytest.raises(ValueError, match="world size"):
        opt.load_state_dict(bad)
    return (
        {n: p.detach().clone() for n, p in model.named_parameters()},
        held,
        opt.owned,
        bytes_sent()["all_gather"],
    )


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_optimizer_matches_adamw_and_holds_only_its_share(world):
    ref = _reference()
    results = launch(_sharded_case, world, timeout=120)
    owned = results[0][2]
    assert sorted(i for o in owned for i in o) == list(range(len(ref)))
    for rank, (state, held, _, sent) in enumerate(results):
        assert held == owned[rank], f"rank {rank} holds state for {held}, owns {owned[rank]}"
        for name, want in ref.items():
            assert (state[name] - want).abs().max().item() <= ATOL, (rank, name)
        sizes = [p.numel() for p in Toy().parameters()]
        width = max(sum(sizes[i] for i in o) for o in owned)  # padded to the largest share
        assert sent == STEPS * width * world * 4 * (world - 1) // world


# ------------------------------------------------------------------ partitioning
def _best_max_load(sizes, world):
    return min(
        max(sum(s for s, r in zip(sizes, assign) if r == k) for k in range(world))
        for assign in itertools.product(range(world), repeat=len(sizes))
    )


def test_partition_parameters():
    assert partition_parameters([4, 3, 3, 2, 2], 2) == [[0, 3, 4], [1, 2]]  # LPT by hand
    assert partition_parameters([], 3) == [[], [], []]
    # the docstring's tie rules by hand: equal sizes lower index first, equal loads lower rank
    assert partition_parameters([1, 1], 2) == [[0], [1]]
    assert partition_parameters([2, 3, 2, 3], 2) == [[0, 1], [2, 3]]  # visits 1, 3, 0, 2
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        world = 2 + trial % 3
        sizes = torch.randint(1, 50, (7,), generator=g).tolist()
        parts = partition_parameters(sizes, world)
        assert sorted(i for p in parts for i in p) == list(range(7))
        assert all(p == sorted(p) for p in parts)
        worst = max(sum(sizes[i] for i in p) for p in parts)
        assert worst <= 4 / 3 * _best_max_load(sizes, world)  # Graham's bound for LPT
        assert parts == partition_parameters(sizes, world)  # deterministic
    with pytest.raises(ValueError, match="0"):
        partition_parameters([1], 0)


# ------------------------------------------------------------------ formulas
def test_memory_formula_reproduces_the_papers_figure_1():
    # Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, N = 64, K = 12 → 120, 31.4, 16.6, 1.88 GB
    psi = 7.5e9
    totals = [memory_formula(int(psi), 64, s, "mixed")["total"] / 1e9 for s in range(4)]
    assert [round(t, 2) for t in totals] == [120.0, 31.41, 16.64, 1.88]
    fp32 = memory_formula(1000, 4, 2)
    assert (fp32["params"], fp32["grads"], fp32["optimizer"]) == (4000, 1000, 2000)
    off = memory_formula(1000, 4, 2, offload=True)
    assert off["optimizer"] == 0 and off["host"] == 2000
    with pytest.raises(ValueError, match="fp16"):
        memory_formula(1, 1, 1, "fp16")
    with pytest.raises(ValueError, match="4"):
        memory_formula(1, 1, 4)


def test_communication_formula():
    assert communication_formula(1000, 4, 0) == 2 * 1000 * 4 * 3 / 4  # DP all-reduce
    assert communication_formula(1000, 4, 2) == communication_formula(1000, 4, 0)
    assert communication_formula(1000, 4, 3) == 1.5 * communication_formula(1000, 4, 1)
    assert communication_formula(1000, 1, 3) == 0


# ------------------------------------------------------------------ memory and communication
def _measure_all():
    return [_measure(stage) for stage in range(4)]


def _measure(stage):
    from minitrain.zero import ZeroDataParallel, bytes_sent, dp_memory_bytes, reset_bytes_sent

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Toy()
    sizes = [p.numel() for p in model.parameters()]
    if stage == 0:
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        step, zg, mem = opt.step, opt.zero_grad, lambda: dp_memory_bytes(model, opt)
    else:
        z = ZeroDataParallel(model, torch.optim.AdamW, stage, lr=LR, bucket_cap_mb=1e-4)
        model, step, zg, mem = z, z.step, z.zero_grad, z.memory_bytes
    units = [u.numel for u in z.units if u is not None] if stage else [sum(sizes)]
    x, y = toy_batch(0, rank, world)
    zg()
    ((model(x) - y) ** 2).mean().backward()
    reset_bytes_sent()
    zg()
    ((model(x) - y) ** 2).mean().backward()
    step()
    return mem(), bytes_sent(), units


@pytest.mark.parametrize("world", [1, 2, 4])
def test_memory_and_communication_match_the_formulas(world):
    for stage, (mem, sent, units) in enumerate(launch(_measure_all, world, timeout=60)[-1]):
        psi = sum(units)
        padded = sum(-(-n // world) * world for n in units)  # each unit rounded up to N·k
        assert padded - psi < world * len(units)
        f = memory_formula(padded if stage else psi, world, stage)
        for part in ("params", "grads", "optimizer"):
            assert mem[part] == f[part], f"stage {stage}, N={world}: {part} {mem} vs {f}"
        if stage:
            assert sent["total"] == communication_formula(padded, world, stage), (stage, sent)
            assert sent["all_reduce"] == 0


# ------------------------------------------------------------------ stage 3 mechanics
def _stage3_trace():
    from minitrain.runtime import trace
    from minitrain.zero import ZeroDataParallel

    torch.manual_seed(0)
    z = ZeroDataParallel(Toy(n=4), torch.optim.AdamW, 3, lr=LR)
    x, y = toy_batch(0, dist.get_rank(), dist.get_world_size())
    freed_during_forward = []

    def check(module, args, output):
        freed_during_forward.append(
            [b.fc.weight.untyped_storage().nbytes() == 0 for b in z.module.blocks]
        )

    z.module.out.register_forward_hook(check)
    trace.reset()
    ((z(x) - y) ** 2).mean().backward()
    z.step()
    all_free = all(p.untyped_storage().nbytes() == 0 for p in z.module.parameters())
    return trace.events(), freed_during_forward[0], all_free


def test_stage3_gathers_twice_frees_and_prefetches():
    events, freed, all_free = launch(_stage3_trace, 2, timeout=60)[0]
    assert freed == [True] * 4, "blocks must be freed right after their forward"
    assert all_free, "after the step only the shards may remain"
    names = [e.name for e in events]
    for i in range(4):
        assert names.count(f"gather block {i}") == 2, names  # forward and backward
        assert f"backward block {i}" in names
    start = {e.name: e for e in events if e.kind != "communication"}
    gathers = [e for e in events if e.name.startswith("gather block")]
    # prefetch: block i+1's gather is launched before block i's forward ends
    for i in range(3):
        nxt = [g for g in gathers if g.name == f"gather block {i + 1}"][0]
        assert nxt.start < start[f"forward block {i}"].end
    # backward runs from the last block to the first
    order = [e.name for e in events if e.name.startswith("backward block")]
    assert order == [f"backward block {i}" for i in reversed(range(4))]


def _stage2_overlap():
    from minitrain.runtime import trace
    from minitrain.zero import ZeroDataParallel

    torch.manual_seed(0)
    z = ZeroDataParallel(Toy(n=4), torch.optim.AdamW, 2, lr=LR, bucket_cap_mb=1e-4)
    x, y = toy_batch(0, dist.get_rank(), dist.get_world_size())
    trace.reset()
    ((z(x) - y) ** 2).mean().backward()
    held = [p.grad is None for p in z.module.parameters()]
    return trace.events(), held, len(z.units)


def test_stage2_reduce_scatters_during_backward_and_keeps_only_shards():
    events, no_full_grads, buckets = launch(_stage2_overlap, 2, timeout=60)[0]
    assert all(no_full_grads), "stage 2 must not keep full gradients"
    backward = [e for e in events if e.name == "backward"][0]
    launches = [e.start for e in events if e.name.startswith("reduce-scatter")]
    assert len(launches) == buckets > 2
    assert min(launches) < backward.end - 1e-6, "the first bucket must start inside backward"


def _bad_stage():
    from minitrain.zero import ZeroDataParallel

    with pytest.raises(ValueError, match="stage must be 1, 2 or 3, got 4"):
        ZeroDataParallel(Toy(), torch.optim.AdamW, 4)
    return True


def test_bad_stage_is_named():
    assert launch(_bad_stage, 1)[0]


def _accumulate_and_eval():
    from minitrain.zero import ZeroDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        z = ZeroDataParallel(Toy(), torch.optim.AdamW, stage, lr=LR, bucket_cap_mb=4e-4)
        for s in range(STEPS):
            x, y = toy_batch(s, rank, world)
            z.zero_grad()
            for half in (slice(0, 3), slice(3, 6)):  # two micro-batches, gradients accumulate
                (((z(x[half]) - y[half]) ** 2).mean() / 2).backward()
            z.step()
        x, _ = toy_batch(99)
        with torch.no_grad():  # evaluation: no backward, no hooks left behind
            prediction = z(x)
        out[stage] = (z.full_state_dict(), prediction)
    return out


def test_gradient_accumulation_and_no_grad_forward():
    ref = _reference()
    model = Toy()
    model.load_state_dict(ref)
    want = model(toy_batch(99)[0]).detach()
    for stage, (state, prediction) in launch(_accumulate_and_eval, 2, timeout=60)[1].items():
        for name in ref:
            assert (state[name] - ref[name]).abs().max().item() <= ATOL, (stage, name)
        assert torch.allclose(prediction, want, atol=1e-5), f"stage {stage} eval output"


def _stage3_in_one_of_two_groups(steps=3):
    """Ranks {0, 2} train with stage 3 on their group, ranks {1, 3} with stage 1 on theirs:
    as data-parallel groups inside a larger mesh, where only one group's ranks build stage 3."""
    from minitrain.zero import ZeroDataParallel

    rank = dist.get_rank()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank makes every group
    group, stage = groups[rank % 2], 3 if rank % 2 == 0 else 1
    torch.manual_seed(0)
    z = ZeroDataParallel(Toy(), torch.optim.AdamW, stage, group=group, lr=LR, bucket_cap_mb=4e-4)
    for s in range(steps):
        x, y = toy_batch(s, rank // 2, 2)
        z.zero_grad()
        ((z(x) - y) ** 2).mean().backward()
        z.step()
    return z.full_state_dict()


def test_stage3_inside_one_data_parallel_group_of_several():
    # stage 3 makes a second group for its gathers, on its own ranks only (the other group's
    # ranks never build one): the mesh of chapter 11 puts ZeRO inside one DP group of several
    ref = _reference(steps=3)
    for rank, state in enumerate(launch(_stage3_in_one_of_two_groups, 4, timeout=60)):
        for name, want in ref.items():
            err = (state[name] - want).abs().max().item()
            assert err <= ATOL, f"rank {rank} (stage {3 if rank % 2 == 0 else 1}): {name} off by {err}"
