"""Context parallelism (chapter 10) against full attention on the gathered sequence.

References are independent of the code under test: torch's scaled_dot_product_attention
(forward and autograd gradients) on the whole sequence, the layout written out from the
contract (rank r holds slice r of P, or slices r and 2P-1-r of 2P), a one-process GPT.
One launch per world size runs every case, to keep the file fast.

Tolerance (fp32, values of order 1): ring attention sums the softmax in P or 2P pieces,
merged by logsumexp, so results differ from SDPA by a few rounding steps: 2e-5 absolute
on outputs and gradients (measured: below 2e-6). The GPT's loss curve: max |Δloss| over 50
AdamW steps below 1e-4 (measured: about 1e-6).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minitrain.runtime import launch

TOL = 2e-5
SHAPE = (2, 2, 24, 8)  # batch, heads, N (divisible by 2P for P = 2 and 3... and 4: 24 = 8·3), d


def _contract_shard(x, rank, world, layout):
    """The layout as the contract states it, written independently of layout.py."""
    if layout == "contiguous":
        n = x.shape[-2] // world
        return x[..., rank * n:(rank + 1) * n, :]
    c = x.shape[-2] // (2 * world)
    first, second = rank, 2 * world - 1 - rank
    return torch.cat([x[..., first * c:(first + 1) * c, :], x[..., second * c:(second + 1) * c, :]], -2)


def _attention_cases():
    from minitrain.context_parallel import gather_sequence, ring_attention, shard_sequence

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for layout in ("contiguous", "zigzag"):
        for causal in (False, True):
            g = torch.Generator().manual_seed(7)
            q, k, v, do = (torch.randn(*SHAPE, generator=g) for _ in range(4))
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = F.scaled_dot_product_attention(*full, is_causal=causal)
            ref.backward(do)
            shards = [shard_sequence(t, layout=layout) for t in (q, k, v, do)]
            layout_ok = all(torch.equal(s, _contract_shard(t, rank, world, layout))
                            for s, t in zip(shards, (q, k, v, do)))
            ql, kl, vl = (s.clone().requires_grad_() for s in shards[:3])
            y = ring_attention(ql, kl, vl, causal=causal, layout=layout)
            y.backward(shards[3])
            errors = {"out": (y.detach() - _contract_shard(ref.detach(), rank, world, layout)).abs().max().item()}
            for name, local, glob in zip("qkv", (ql, kl, vl), full):
                errors["d" + name] = (local.grad - _contract_shard(glob.grad, rank, world, layout)).abs().max().item()
            roundtrip = torch.equal(gather_sequence(shard_sequence(q, layout=layout), layout=layout), q)
            out[(layout, causal)] = (errors, layout_ok, roundtrip)
    if world == 4:  # two rings of 2 inside 4 ranks ({0, 1} and {2, 3}), each on its own data
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        group, sub = groups[rank // 2], rank % 2
        g = torch.Generator().manual_seed(20 + rank // 2)
        q, k, v, do = (torch.randn(*SHAPE, generator=g) for _ in range(4))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(*full, is_causal=True).backward(do)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        shards = [shard_sequence(t, group=group, layout="zigzag") for t in (q, k, v, do)]
        layout_ok = all(torch.equal(s, _contract_shard(t, sub, 2, "zigzag"))
                        for s, t in zip(shards, (q, k, v, do)))
        ql, kl, vl = (s.clone().requires_grad_() for s in shards[:3])
        y = ring_attention(ql, kl, vl, causal=True, group=group, layout="zigzag")
        y.backward(shards[3])
        errors = {"out": (gather_sequence(y.detach(), group=group, layout="zigzag") - ref).abs().max().item()}
        for name, local, glob in zip("qkv", (ql, kl, vl), full):
            errors["d" + name] = (local.grad - _contract_shard(glob.grad, sub, 2, "zigzag")).abs().max().item()
        out[("zigzag in a group of 2", True)] = (errors, layout_ok, True)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_outputs_and_gradients_equal_full_attention(world):
    for rank, cases in enumerate(launch(_attention_cases, world, timeout=120)):
        for (layout, causal), (errors, layout_ok, roundtrip) in cases.items():
            where = f"P={world}, rank {rank}, {layout}, causal={causal}"
            assert layout_ok, f"{where}: shard_sequence does not cut the sequence as the contract says"
            assert roundtrip, f"{where}: gather_sequence(shard_sequence(x)) is not x"
            bad = {k: e for k, e in errors.items() if not e <= TOL}
            assert not bad, f"{where}: differs from SDPA on the whole sequence: {bad}"


def _errors():
    from minitrain.context_parallel import ring_attention, shard_sequence

    messages = []
    odd = torch.zeros(1, 1, 3, 4)  # 3 tokens per rank: N = 12, not a multiple of 2P = 8
    for fn in (lambda: shard_sequence(torch.zeros(1, 1, 10, 4), layout="contiguous"),
               lambda: shard_sequence(torch.zeros(1, 1, 12, 4), layout="zigzag"),
               lambda: ring_attention(odd, odd, odd, layout="zigzag"),
               lambda: shard_sequence(torch.zeros(1, 8, 2), layout="striped")):
        try:
            fn()
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def test_errors_name_the_numbers():
    messages = launch(_errors, 4, timeout=60)[0]
    zigzag = ("sequence length 12 is not divisible by 2P = 8 (P = 4): the zigzag layout cuts "
              "the sequence into 8 equal chunks")
    assert messages[:3] == [
        "sequence length 10 is not divisible by P = 4: the contiguous layout cuts the sequence "
        "into 4 equal chunks", zigzag, zigzag]
    assert "striped" in messages[3] and "zigzag" in messages[3] and len(messages) == 4


def _bytes_and_balance(world):
    from torch.utils.flop_counter import FlopCounterMode

    from minitrain.context_parallel import communication_log, reset_communication_log
    from minitrain.context_parallel.measure import forward_flops, ring_bytes
    from minitrain.context_parallel.ring import ring_attention

    b, h, n, d = 2, 2, 16, 8  # n tokens per rank
    out = {}
    for layout in ("contiguous", "zigzag"):
        q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(3))
        reset_communication_log()
        counter = FlopCounterMode(display=False)
        with counter:
            y = ring_attention(q, k, v, causal=True, layout=layout)
        fwd = sum(x for _, x in communication_log())
        reset_communication_log()
        y.sum().backward()
        bwd = sum(x for _, x in communication_log())
        formula = ring_bytes(b * h, n * world, d, world)
        flops = forward_flops(n * world, world, layout, True, b * h, d)[dist.get_rank()]
        out[layout] = (fwd, bwd, formula, counter.get_total_flops(), flops)
    return out


def test_bytes_and_forward_flops_equal_the_formulas():
    per_rank = launch(_bytes_and_balance, 4, 4, timeout=120)
    block = 2 * 2 * 16 * 8 * 4
    for rank, cases in enumerate(per_rank):
        for layout, (fwd, bwd, formula, flops, want) in cases.items():
            assert fwd == formula["forward"] == 3 * 2 * block, f"rank {rank} {layout}: forward sent {fwd}"
            assert bwd == formula["backward"] == (3 * 2 + 4 * 2) * block, f"rank {rank} {layout}: backward sent {bwd}"
            assert flops == want, f"rank {rank} {layout}: counted {flops} FLOPs, formula {want}"
    contiguous = [r["contiguous"][3] for r in per_rank]
    zigzag = [r["zigzag"][3] for r in per_rank]
    assert contiguous == [contiguous[0] * (r + 1) for r in range(4)], contiguous  # 1:2:3:4 blocks
    # zigzag: balanced; in total a little less, its masked diagonal chunks being half as long
    assert len(set(zigzag)) == 1 and sum(zigzag) < sum(contiguous), zigzag


def _gpt_curves(steps, layout):
    from minitrain.context_parallel import ContextParallelGPT
    from minitrain.data import get_batch
    from minitrain.model import GPT, GPTConfig

    config = GPTConfig(vocab_size=64, seq_len=32, n_layer=2, n_head=2, d_model=32)
    torch.manual_seed(0)
    dense = GPT(config)
    rank, world = dist.get_rank(), dist.get_world_size()
    cp_group, dp_group, dp = None, None, 1
    if world == 4:  # CP-2 inside DP-2: every rank creates every group, in the same order
        cps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        cp_group, dp_group, dp = cps[rank // 2], dps[rank % 2], 2
    torch.manual_seed(0)
    cp = ContextParallelGPT(GPT(config), group=cp_group, layout=layout)
    opt_d = torch.optim.AdamW(dense.parameters(), lr=3e-3)
    opt_c = torch.optim.AdamW(cp.parameters(), lr=3e-3)
    curve_d, curve_c = [], []
    for step in range(steps):
        x, y = get_batch(step, 4, vocab_size=64, seq_len=32)
        if dist.get_rank() == 0:  # the one-process reference (once: the cores are shared)
            loss = dense.loss(x, y)
            opt_d.zero_grad()
            loss.backward()
            opt_d.step()
            curve_d.append(loss.item())
        if dp > 1:  # this data-parallel replica's half of the batch
            half = slice((rank // 2) * 2, (rank // 2) * 2 + 2)
            x, y = x[half], y[half]
        local = cp.loss(cp.shard(x), cp.shard(y))
        opt_c.zero_grad()
        local.backward()
        cp.finish_gradient_synchronization()
        loss = torch.tensor(cp.average_loss(local))
        if dp > 1:
            for p in cp.parameters():
                dist.all_reduce(p.grad, group=dp_group)
                p.grad /= dp
            dist.all_reduce(loss, group=dp_group)
            loss /= dp
        opt_c.step()
        curve_c.append(loss.item())
    return curve_d, curve_c


@pytest.mark.parametrize("world,layout,steps", [(2, "zigzag", 50), (4, "contiguous", 15)])
def test_gpt_loss_curve_equals_one_process(world, layout, steps):
    """CP-2 alone; and on 4 ranks CP-2 × DP-2 (CP groups {0, 1}, {2, 3}, each on half the
    batch, gradients then averaged over the data-parallel pairs {0, 2}, {1, 3})."""
    results = launch(_gpt_curves, world, steps, layout, timeout=180)
    dense = results[0][0]
    for rank, (_, cp) in enumerate(results):
        gap = max(abs(a - b) for a, b in zip(dense, cp))
        assert len(cp) == len(dense) == steps
        assert gap < 1e-4, f"rank {rank}: CP-{world} {layout} loss differs from one process by {gap}"
    assert dense[-1] < dense[0] - 0.3, f"the model should learn: {dense[0]} -> {dense[-1]}"
