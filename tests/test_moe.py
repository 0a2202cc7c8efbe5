"""Chapter 8: routing, the balancing losses, dispatch, the MoE layer and expert parallelism,
each against an independent reference (Python loops over tokens, formulas, the local layer
with the same weights on one process)."""

import math

import pytest
import torch
import torch.nn.functional as F

from minitrain.moe import (
    ExpertParallelMoE,
    MoELayer,
    expert_capacity,
    load_balancing_loss,
    router_z_loss,
    sort_by_expert,
    top_k_routing,
    unsort,
)
from minitrain.runtime import get_device, launch


def tokens(*shape, generator=None):
    """Tokens where an MoE layer built without ``device=`` lives, ``get_device()`` (issue 29):
    drawn on the CPU (the same numbers on every device), then moved there — a layer on a GPU
    rank given CPU tokens fails (issue 41)."""
    return torch.randn(*shape, generator=generator, device="cpu").to(get_device())


# ------------------------------------------------------------------ references (loops)
def reference_routing(probs, k, capacity, bias=None):
    """Top-k by Python sorting, weights renormalised, capacity filled first choices first,
    then earlier tokens first (GShard's priority)."""
    T, E = probs.shape
    scores = probs if bias is None else probs + bias
    chosen = [sorted(range(E), key=lambda e: (-float(scores[t, e]), e))[:k] for t in range(T)]
    weights = [[float(probs[t, e]) / sum(float(probs[t, j]) for j in chosen[t]) for e in chosen[t]]
               for t in range(T)]
    used, keep = [0] * E, [[False] * k for _ in range(T)]
    for j in range(k):
        for t in range(T):
            e = chosen[t][j]
            keep[t][j] = used[e] < capacity
            used[e] += 1
    return torch.tensor(chosen), torch.tensor(weights), torch.tensor(keep)


def reference_moe(layer, x):
    """y_t = Σ_kept w · MLP_e(x_t), token by token, from the layer's weights."""
    probs = torch.softmax(x @ layer.router.gate.weight.t(), dim=-1)
    cap = expert_capacity(x.shape[0], layer.num_experts, layer.top_k,
                          layer.router.capacity_factor)
    idx, _, keep = reference_routing(probs.detach(), layer.top_k, cap)
    ex, rows = layer.experts, []
    for t in range(x.shape[0]):
        chosen = probs[t, idx[t]]
        y = torch.zeros(layer.d_model, device=x.device)
        for j in range(layer.top_k):
            if keep[t, j]:
                e = int(idx[t, j])
                h = F.gelu(x[t] @ ex.w_in[e] + ex.b_in[e])
                # Switch gates top-1 by the raw probability; top-k > 1 renormalises
                w = chosen[j] if layer.top_k == 1 else chosen[j] / chosen.sum()
                y = y + w * (h @ ex.w_out[e] + ex.b_out[e])
        rows.append(y)
    return torch.stack(rows)


def _probs(T, E, seed):
    return torch.softmax(torch.randn(T, E, generator=torch.Generator().manual_seed(seed)), -1)


# ------------------------------------------------------------------------------ routing
def test_capacity_formula():
    assert expert_capacity(10, 4, 2, 1.0) == 5  # ⌈1·2·10/4⌉
    assert expert_capacity(10, 4, 1, 1.25) == 4  # ⌈3.125⌉
    assert expert_capacity(12, 4, 1, 1.0) == 3  # exact: no rounding up
    assert expert_capacity(10, 4, 2, None) == 20
    with pytest.raises(ValueError, match="-1"):
        expert_capacity(10, 4, 1, -1)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("capacity_factor", [None, 0.5, 1.0, 1.25])
def test_top_k_routing_matches_the_loop_reference(k, capacity_factor):
    for seed in range(3):
        probs = _probs(13, 5, seed)
        cap = expert_capacity(13, 5, k, capacity_factor)
        idx, w, keep = top_k_routing(probs, k, cap)
        ridx, rw, rkeep = reference_routing(probs, k, cap)
        assert torch.equal(idx, ridx)
        torch.testing.assert_close(w, rw.float())
        assert torch.equal(keep, rkeep), f"capacity {cap}: kept {keep.sum()} vs {rkeep.sum()}"


def test_weights_are_renormalised_and_bias_only_chooses():
    probs = _probs(20, 6, 7)
    _, w, _ = top_k_routing(probs, 2, 40)
    torch.testing.assert_close(w.sum(-1), torch.ones(20))
    bias = torch.zeros(6)
    bias[5] = 10.0  # expert 5 is everyone's first choice, but its weight stays its probability
    idx, w, _ = top_k_routing(probs, 2, 40, bias)
    assert (idx[:, 0] == 5).all()
    ridx, rw, _ = reference_routing(probs, 2, 40, bias)
    assert torch.equal(idx, ridx)
    torch.testing.assert_close(w, rw.float())


def test_load_is_counted_only_for_the_bias_that_reads_it():
    """Issue 40: in aux-loss mode nothing ever reset ``observed_load``: it grew for ever."""
    layer = MoELayer(4, 8, 4, top_k=2)  # balancing="aux_loss"
    layer(tokens(6, 4))
    assert layer.router.observed_load.sum() == 0
    biased = MoELayer(4, 8, 4, top_k=2, balancing="bias")
    biased(tokens(6, 4))
    assert biased.router.observed_load.sum() == 12  # 6 tokens × 2 choices


def test_bias_update_follows_the_load():
    layer = MoELayer(4, 8, 4, balancing="bias", bias_update_rate=0.1)
    here = get_device()  # where the layer was built
    layer.router.update_bias(torch.tensor([10.0, 0.0, 3.0, 3.0], device=here))  # mean 4
    torch.testing.assert_close(layer.router.expert_bias,
                               torch.tensor([-0.1, 0.1, 0.1, 0.1], device=here))
    assert layer.router.observed_load.sum() == 0


# ------------------------------------------------------------------------------- losses
def test_load_balancing_loss_against_the_formula():
    E = 4
    uniform = torch.full((8, E), 1 / E)
    assert load_balancing_loss(uniform, torch.arange(8) % E, E).item() == pytest.approx(1.0)
    one_hot = F.one_hot(torch.zeros(8, dtype=torch.long), E).float()
    assert load_balancing_loss(one_hot, torch.zeros(8, dtype=torch.long), E).item() == E
    probs = _probs(9, E, 3).requires_grad_()
    idx = torch.topk(probs, 2, -1).indices
    f = [sum(int(i == e) for i in idx.flatten()) / idx.numel() for e in range(E)]
    want = E * sum(f[e] * probs[:, e].mean() for e in range(E))
    got = load_balancing_loss(probs, idx, E)
    torch.testing.assert_close(got, want)
    (g,) = torch.autograd.grad(got, probs)
    torch.testing.assert_close(g, torch.tensor(f).expand(9, E) * E / 9)


def test_z_loss():
    logits = torch.randn(5, 3)
    want = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 5
    assert router_z_loss(logits).item() == pytest.approx(want, rel=1e-5)


# ----------------------------------------------------------------------------- dispatch
def test_sort_by_expert_and_unsort():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(11, 3, generator=g, requires_grad=True)
    ex = torch.randint(0, 4, (11,), generator=g)
    ex[ex == 2] = 3  # expert 2 gets nothing
    sorted_rows, order, counts = sort_by_expert(rows, ex, 5)
    want = sorted(range(11), key=lambda i: (int(ex[i]), i))  # stable
    assert order.tolist() == want
    assert counts.tolist() == [int((ex == e).sum()) for e in range(5)]
    assert torch.equal(sorted_rows, rows[want])
    back = unsort(sorted_rows, order)
    assert torch.equal(back, rows)
    back.backward(torch.arange(33.0).view(11, 3))
    assert torch.equal(rows.grad, torch.arange(33.0).view(11, 3))


# --------------------------------------------------------------------------- the layer
@pytest.mark.parametrize("k,capacity_factor", [(1, None), (2, None), (1, 0.5), (2, 0.25)])
def test_moe_layer_matches_the_token_loop(k, capacity_factor):
    torch.manual_seed(0)
    layer = MoELayer(6, 10, 4, top_k=k, capacity_factor=capacity_factor, aux_loss_weight=0)
    x = tokens(14, 6).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = layer(x), reference_moe(layer, x_ref)
    torch.testing.assert_close(y, y_ref)
    g = torch.randn_like(y)
    params = [layer.router.gate.weight, *layer.experts.parameters()]
    got = torch.autograd.grad(y, [x, *params], g)
    want = torch.autograd.grad(y_ref, [x_ref, *params], g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    if capacity_factor is not None:  # dropped tokens: output 0
        dropped = ~layer.last_routing.keep.any(-1)
        assert dropped.any() and (y[dropped] == 0).all()


def test_switch_top1_router_learns_from_the_task_loss_alone():
    """Switch (Fedus et al. 2021, eq. 2) gates top-1 by the raw probability, so the task loss
    alone (no aux loss) trains the router: d/dW of Σ y·g equals the formula's, and is not ~0.
    Top-2 keeps renormalised weights that sum to 1 (GShard / Mixtral)."""
    torch.manual_seed(0)
    layer = MoELayer(6, 10, 4, top_k=1, aux_loss_weight=0)
    x = tokens(14, 6)
    g = tokens(14, 6)
    (layer(x) * g).sum().backward()
    grad = layer.router.gate.weight.grad
    # the formula by hand: y_t = p_e(x_t) · E_e(x_t), e = argmax p
    w = layer.router.gate.weight.detach().clone().requires_grad_()
    probs = torch.softmax(x @ w.t(), dim=-1)
    e = probs.argmax(-1)
    ex = layer.experts
    out = torch.stack([F.gelu(x[t] @ ex.w_in[e[t]] + ex.b_in[e[t]]) @ ex.w_out[e[t]]
                       + ex.b_out[e[t]] for t in range(14)]).detach()
    (probs.gather(-1, e[:, None]) * out * g).sum().backward()
    torch.testing.assert_close(grad, w.grad)
    assert grad.abs().max() > 1e-3, f"top-1 router gradient {grad.abs().max():.2e}: gated by 1?"
    top2 = MoELayer(6, 10, 4, top_k=2, aux_loss_weight=0)
    top2(x)
    torch.testing.assert_close(top2.last_routing.weights.sum(-1), torch.ones(14, device=x.device))


def test_moe_gpt_adds_aux_loss_and_trains():
    from minitrain.data import get_batch
    from minitrain.model import GPT, GPTConfig
    from minitrain.moe import apply_moe, moe_aux_loss, moe_training_loss
    from minitrain.moe.measure import parameter_counts

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16)
    model = apply_moe(GPT(cfg), num_experts=4, top_k=2, capacity_factor=1.0, z_loss_weight=1e-3)
    x, y = get_batch(0, 4, vocab_size=32, seq_len=8)
    loss = moe_training_loss(model, x, y)
    aux = moe_aux_loss(model)
    assert aux.item() > 0
    torch.testing.assert_close(loss, model.loss(x, y) + moe_aux_loss(model))
    loss.backward()
    assert model.blocks[0].mlp.router.gate.weight.grad.abs().sum() > 0
    # the aux loss rides on the layers' backward: the same gradients as adding it explicitly
    import copy

    explicit = copy.deepcopy(model)
    explicit.zero_grad()
    for m in explicit.modules():
        if isinstance(m, MoELayer):
            m.aux_loss_in_backward = False
    (explicit.loss(x, y) + moe_aux_loss(explicit)).backward()
    for (name, a), b in zip(model.named_parameters(), explicit.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=f"{name}: aux gradient differs")
    counts = parameter_counts(model)
    per_expert = 2 * 16 * 64 + 64 + 16
    assert counts["total"] - counts["active"] == 2 * (4 - 2) * per_expert


# ------------------------------------------------------------------ expert parallelism
def _chunk(rank, T, d, seed=10):
    x = tokens(T, d, generator=torch.Generator(device="cpu").manual_seed(seed + rank))
    return x.abs() if seed < 0 else x


def _ep_case(E, k, capacity_factor, skew, T):
    import torch.distributed as dist

    from minitrain.moe import communication_log, reset_communication_log

    rank, P, d = dist.get_rank(), dist.get_world_size(), 6
    torch.manual_seed(0)
    local = MoELayer(d, 8, E, top_k=k, capacity_factor=capacity_factor, z_loss_weight=0.1)
    if skew:  # every token prefers expert 0: ranks other than 0 receive nothing (k = 1)
        with torch.no_grad():
            local.router.gate.weight.zero_()
            local.router.gate.weight[0, 0] = 50.0
    chunks = [_chunk(r, T, d).abs() if skew else _chunk(r, T, d) for r in range(P)]
    grads = [tokens(T, d, generator=torch.Generator(device="cpu").manual_seed(99 + r))
             for r in range(P)]
    ep = ExpertParallelMoE.from_local(local)
    # reference: the local layer on each rank's tokens; the loss is the mean over ranks
    xs = [c.clone().requires_grad_() for c in chunks]
    ref_out, total, per, into_me = [], 0, E // P, 0
    for r in range(P):
        out = local(xs[r])
        ref_out.append(out.detach())
        kept = local.last_routing.indices[local.last_routing.keep]
        into_me += int((kept // per == rank).sum()) if r != rank else 0
        total = total + ((out * grads[r]).sum() + local.aux_loss) / P
        if r == rank:
            ref_routing = local.last_routing
    total.backward()
    x = chunks[rank].clone().requires_grad_()
    reset_communication_log()
    y = ep(x)
    ((y * grads[rank]).sum() + ep.aux_loss).backward()
    ep.finish_gradient_synchronization()
    off_rank = sum(int(((ref_routing.indices[ref_routing.keep] // per) == p).sum())
                   for p in range(P) if p != rank)
    return {
        "out": (y.detach() - ref_out[rank]).abs().max().item(),
        "x": (x.grad - P * xs[rank].grad).abs().max().item(),
        "router": (ep.router.gate.weight.grad - local.router.gate.weight.grad).abs().max().item(),
        "experts": max((a.grad - b.grad[rank * per:(rank + 1) * per]).abs().max().item()
                       for a, b in zip(ep.experts.parameters(), local.experts.parameters())),
        "log": communication_log(),
        "off_rank_bytes": off_rank * d * 4,  # fp32 rows of d values
        "into_me_bytes": into_me * d * 4,
        "dropped": ref_routing.dropped_fraction,
    }


@pytest.mark.parametrize("P,k", [(2, 1), (2, 2), (4, 1), (4, 2)])
def test_expert_parallel_equals_the_local_layer(P, k):
    results = launch(_ep_case, P, 8, k, None, False, 12, timeout=90)
    for rank, r in enumerate(results):
        for what in ("out", "x", "router", "experts"):
            assert r[what] < 1e-5, f"rank {rank}: {what} differs by {r[what]}"
        names = [name for name, _ in r["log"]]
        assert names == ["dispatch", "combine", "combine (backward)", "dispatch (backward)"]
        # a rank sends its rows for other ranks' experts, and returns the rows it received
        want = [r["off_rank_bytes"], r["into_me_bytes"], r["off_rank_bytes"], r["into_me_bytes"]]
        assert [nbytes for _, nbytes in r["log"]] == want, r["log"]


@pytest.mark.parametrize("P,k,capacity_factor", [(2, 1, None), (4, 1, 1.0), (2, 2, 0.5)])
def test_expert_parallel_skewed_and_over_capacity(P, k, capacity_factor):
    """All tokens to expert 0 (the other ranks receive nothing when k = 1), and with a
    capacity most of them are dropped — still the local layer's outputs and gradients."""
    results = launch(_ep_case, P, 4, k, capacity_factor, True, 10, timeout=90)
    for rank, r in enumerate(results):
        for what in ("out", "x", "router", "experts"):
            assert r[what] < 1e-5, f"rank {rank}: {what} differs by {r[what]}"
        if k == 1 and rank > 0:  # every kept row goes to rank 0; nothing comes back here
            assert r["into_me_bytes"] == 0 and r["log"][1] == ("combine", 0)
        if capacity_factor is not None:
            assert r["dropped"] > 0.3


def _bad_counts_case():
    import torch.distributed as dist

    import minitrain.moe.dispatchers as ep_module

    real = ep_module.exchange_counts

    def wrong(counts, group=None):  # rank 1 believes it receives one row more from rank 0
        got = real(counts, group)
        if dist.get_rank() == 1:
            got = got.clone()
            got[0] += 1
        return got

    ep_module.exchange_counts = wrong
    torch.manual_seed(0)
    ep = ExpertParallelMoE.from_local(MoELayer(4, 8, 2))
    try:
        ep(tokens(6, 4))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_disagreeing_splits_fail_on_every_rank_naming_ranks_and_counts():
    import torch.distributed as dist  # noqa: F401

    messages = launch(_bad_counts_case, 2, timeout=60)
    for message in messages:
        assert "splits disagree" in message and "to rank 1, which expects" in message, message
    assert messages[0] == messages[1]


def _not_divisible():
    try:
        ExpertParallelMoE.from_local(MoELayer(4, 8, 6))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_experts_not_divisible_by_ranks():
    message = launch(_not_divisible, 4, timeout=60)[0]
    assert "num_experts=6" in message and "expert-parallel size 4" in message


def _bias_case():
    import torch.distributed as dist

    rank, P = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    local = MoELayer(6, 8, 4, balancing="bias", bias_update_rate=0.05)
    ep = ExpertParallelMoE.from_local(local)
    chunks = [_chunk(r, 10, 6) for r in range(P)]
    for c in chunks:
        local(c)
    local.router.update_bias()
    ep(chunks[rank])
    ep.update_bias()
    return (ep.router.expert_bias - local.router.expert_bias).abs().max().item()


def test_expert_parallel_bias_update_equals_local():
    assert launch(_bias_case, 2, timeout=60) == [0.0, 0.0]


def _ep_gpt_case(checkpointing):
    """The MoE GPT, expert-parallel over the ranks with the rest data-parallel (each rank its
    slice of the batch), optionally with every block checkpointed: loss and every gradient
    equal the local model's for the mean of the ranks' losses."""
    import copy

    import torch.distributed as dist

    from minitrain.checkpointing import set_checkpointing
    from minitrain.data import get_batch
    from minitrain.model import GPT, GPTConfig
    from minitrain.moe import (
        apply_expert_parallel,
        apply_moe,
        expert_parallel_gradient_sync,
        moe_training_loss,
    )

    rank, P = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16)
    local = apply_moe(GPT(cfg), num_experts=4, top_k=2, capacity_factor=1.0, z_loss_weight=1e-3)
    ep = apply_expert_parallel(copy.deepcopy(local))
    if checkpointing:
        set_checkpointing(ep, "full")
    batches = [get_batch(0, 4 * P, r, P, vocab_size=32, seq_len=8) for r in range(P)]
    # the reference adds its aux losses to the loss explicitly, not through the layers
    for m in local.modules():
        if isinstance(m, MoELayer):
            m.aux_loss_in_backward = False
    losses = [moe_training_loss(local, x, y) for x, y in batches]
    (sum(losses) / P).backward()
    loss = moe_training_loss(ep, *batches[rank])
    loss.backward()
    expert_parallel_gradient_sync(ep)
    diffs = {"loss": abs(loss.item() - losses[rank].item())}
    reference = dict(local.named_parameters())
    per = 4 // P
    for name, p in ep.named_parameters():
        want = reference[name].grad
        if ".experts." in name:
            want = want[rank * per:(rank + 1) * per]
        diffs[name] = (p.grad - want).abs().max().item()
    return diffs


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_expert_parallel_gpt_with_data_parallel_rest_equals_local(checkpointing):
    for rank, diffs in enumerate(launch(_ep_gpt_case, 2, checkpointing, timeout=90)):
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] < 1e-5, f"rank {rank}: {worst} differs by {diffs[worst]}"
        assert any(".router." in n for n in diffs) and any(".experts." in n for n in diffs)


def test_aux_loss_scale_weights_the_carried_gradient():
    """Two micro-batches averaged: scale 1/2 gives the gradient of mean(lm + aux)."""
    import copy

    from minitrain.data import get_batch
    from minitrain.model import GPT, GPTConfig
    from minitrain.moe import apply_moe, moe_aux_loss, set_aux_loss_scale

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=16)
    model = apply_moe(GPT(cfg), num_experts=4, top_k=2)
    explicit = copy.deepcopy(model)
    for m in explicit.modules():
        if isinstance(m, MoELayer):
            m.aux_loss_in_backward = False
    set_aux_loss_scale(model, 0.5)
    for step in range(2):
        x, y = get_batch(step, 4, vocab_size=32, seq_len=8)
        (model.loss(x, y) / 2).backward()
        ((explicit.loss(x, y) + moe_aux_loss(explicit)) / 2).backward()
    gate = model.blocks[0].mlp.router.gate.weight.grad
    torch.testing.assert_close(gate, explicit.blocks[0].mlp.router.gate.weight.grad)


@pytest.mark.parametrize("policy,k", [("full", 1), ("segments", 2)])
def test_router_load_is_counted_once_under_checkpointing(policy, k):
    """Issue 26: the recompute ran the router again and counted its load a second time.
    Reference: the same model and steps without checkpointing (two forward+backward, then a
    bias update, then one more: the load and the bias it moves must be the plain run's)."""
    import copy

    from minitrain.checkpointing import set_checkpointing
    from minitrain.data import get_batch
    from minitrain.model import GPT, GPTConfig
    from minitrain.moe import apply_moe, moe_layers

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, seq_len=8, n_layer=3, n_head=2, d_model=16, dropout=0.1)
    plain = apply_moe(GPT(cfg), num_experts=4, top_k=2, balancing="bias", bias_update_rate=0.1)
    ours = set_checkpointing(copy.deepcopy(plain), policy, k)
    for model in (plain, ours):
        torch.manual_seed(1)
        for step in range(3):
            x, y = get_batch(step, 4, vocab_size=32, seq_len=8)
            model.loss(x, y).backward()
            if step == 1:
                for layer in moe_layers(model):
                    layer.router.update_bias()
    for i, (a, b) in enumerate(zip(moe_layers(plain), moe_layers(ours))):
        assert a.router.observed_load.sum() > 0
        torch.testing.assert_close(b.router.observed_load, a.router.observed_load, rtol=0, atol=0,
                                   msg=f"layer {i}: checkpointed load differs from the plain run")
        torch.testing.assert_close(b.router.expert_bias, a.router.expert_bias, rtol=0, atol=0)
    for (name, a), b in zip(plain.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=f"{name}: checkpointed gradient differs")
