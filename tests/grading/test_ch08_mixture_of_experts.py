"""Graded tests of chapter 8: your top-k routing with capacity, your dispatch permutation and
its inverse, and your load-balancing loss — each against a reference written with plain
Python loops or the closed-form formula; then your functions drive the whole MoE layer and
its expert-parallel version over 2 ranks."""

import pytest
import torch
import torch.nn.functional as F

from minitrain.runtime import get_device, launch


def _tokens(T, d, seed):
    """T tokens of width d where an MoE layer built without ``device=`` lives, ``get_device()``:
    drawn on the CPU (the same numbers on every device), then moved there (issue 41)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(T, d, generator=gen, device="cpu").to(get_device())


def _probs(T, E, seed):
    return torch.softmax(torch.randn(T, E, generator=torch.Generator().manual_seed(seed)), -1)


def _reference_routing(probs, k, capacity, bias=None):
    """Top-k by sorting each row; weights renormalised; capacity filled with every token's
    first choice before any second choice, earlier tokens first."""
    T, E = probs.shape
    scores = probs if bias is None else probs + bias
    chosen = [sorted(range(E), key=lambda e: (-float(scores[t, e]), e))[:k] for t in range(T)]
    weights = [[float(probs[t, e]) / sum(float(probs[t, j]) for j in chosen[t]) for e in chosen[t]]
               for t in range(T)]
    used, keep = [0] * E, [[False] * k for _ in range(T)]
    for j in range(k):
        for t in range(T):
            keep[t][j] = used[chosen[t][j]] < capacity
            used[chosen[t][j]] += 1
    return torch.tensor(chosen), torch.tensor(weights), torch.tensor(keep)


@pytest.mark.exercise("top_k_routing", points=4)
def test_top_k_routing():
    from minitrain.moe.router import top_k_routing

    for k, capacity in [(1, 100), (2, 100), (1, 3), (2, 4), (3, 2)]:
        probs = _probs(12, 5, k * 10 + capacity)
        indices, weights, keep = top_k_routing(probs, k, capacity)
        want_i, want_w, want_k = _reference_routing(probs, k, capacity)
        assert torch.equal(indices, want_i), (
            f"top_k_routing, top-{k}: chose experts {indices.tolist()}, the {k} most probable are {want_i.tolist()}")
        if weights.shape == want_w.shape and not torch.allclose(weights, want_w.float(), atol=1e-6):
            t = int((weights - want_w.float()).abs().amax(-1).argmax())  # the worst token
        else:
            t = 0
        assert torch.allclose(weights, want_w.float(), atol=1e-6), (
            f"top_k_routing, top-{k}: token {t}'s weights are "
            f"{[round(w, 4) for w in weights[t].tolist()]} (they sum to "
            f"{float(weights[t].sum()):.4g}); they should be the chosen probabilities divided by "
            f"their sum, {[round(w, 4) for w in want_w[t].tolist()]} (each row sums to 1)")
        assert torch.equal(keep, want_k), (
            f"top_k_routing, top-{k} with capacity {capacity}: kept {keep.int().tolist()}, expected "
            f"{want_k.int().tolist()} — each expert keeps at most {capacity} assignments, every "
            "token's first choice before any second choice, earlier tokens first")
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 5.0])
    probs = _probs(8, 5, 1)
    indices, weights, _ = top_k_routing(probs, 2, 100, bias)
    want_i, want_w, _ = _reference_routing(probs, 2, 100, bias)
    assert torch.equal(indices, want_i), (
        "top_k_routing, top-2 of 5 experts, bias [0, 0, 0, 0, 5]: the selection bias must be "
        f"added to the scores to choose: chose {indices.tolist()}, expected {want_i.tolist()}")
    t = int((weights - want_w.float()).abs().amax(-1).argmax()) if weights.shape == want_w.shape else 0
    assert torch.allclose(weights, want_w.float(), atol=1e-6), (
        f"top_k_routing, top-2 of 5 experts, bias [0, 0, 0, 0, 5]: token {t}'s weights are "
        f"{[round(w, 4) for w in weights[t].tolist()]}, expected "
        f"{[round(w, 4) for w in want_w[t].tolist()]} — the bias only chooses the experts; "
        f"the weights are still the chosen probabilities (without the bias), renormalised")


@pytest.mark.exercise("sort_by_expert", points=2)
def test_sort_by_expert():
    from minitrain.moe.dispatch import sort_by_expert

    g = torch.Generator().manual_seed(3)
    rows = torch.randn(10, 3, generator=g, requires_grad=True)
    experts = torch.tensor([2, 0, 2, 3, 0, 0, 3, 2, 0, 3])  # expert 1 and 4 get nothing
    sorted_rows, order, counts = sort_by_expert(rows, experts, 5)
    want = sorted(range(10), key=lambda i: (int(experts[i]), i))
    assert order.tolist() == want, (
        f"order should list the rows of expert 0 first, then 1, ..., keeping their original "
        f"order within an expert: expected {want}, got {order.tolist()}")
    assert counts.tolist() == [4, 0, 3, 3, 0], (
        f"counts should be [4, 0, 3, 3, 0] (one per expert, zeros included), got {counts.tolist()}")
    assert torch.equal(sorted_rows, rows[want]), "sorted_rows should be rows[order]"
    sorted_rows.sum().backward()
    assert rows.grad is not None and torch.equal(rows.grad, torch.ones(10, 3)), (
        "sorted_rows must stay differentiable in rows")
    # many ties: an unstable sort keeps small inputs in order by luck, not 64 rows of 3 experts
    many = torch.randint(0, 3, (64,), generator=g)
    _, order, _ = sort_by_expert(torch.randn(64, 2, generator=g), many, 3)
    want = sorted(range(64), key=lambda i: (int(many[i]), i))
    assert order.tolist() == want, (
        f"sort_by_expert of 64 rows over 3 experts (many ties): within an expert the rows must "
        f"keep their original order — a stable sort (torch.argsort(..., stable=True)); the "
        f"first difference is at position {next(i for i, (a, b) in enumerate(zip(order.tolist(), want)) if a != b)}: "
        f"the layer's unsort, capacity drop and expert parallelism all rely on that order")


@pytest.mark.exercise("unsort", points=2)
def test_unsort():
    from minitrain.moe.dispatch import unsort

    order = torch.tensor([3, 0, 4, 1, 2])
    original = torch.arange(15.0).view(5, 3)
    permuted = original[order].clone().requires_grad_()
    back = unsort(permuted, order)
    assert back.requires_grad, (
        "unsort of 5 rows that require grad returned rows that do not: the result must stay "
        "differentiable in sorted_rows (write them back with an autograd operation such as "
        "index_copy, not in place into a detached buffer)")
    assert torch.equal(back, original), (
        f"unsort(rows[order], order) should give the rows back: expected {original.tolist()}, "
        f"got {back.tolist()}")
    back.backward(torch.arange(15.0).view(5, 3))
    assert torch.equal(permuted.grad, original[order]), (
        "unsort: the gradient of unsort is the forward permutation: row i receives row "
        "order[i]'s gradient")


@pytest.mark.exercise("load_balancing_loss", points=3)
def test_load_balancing_loss():
    from minitrain.moe.losses import load_balancing_loss

    uniform = load_balancing_loss(torch.full((8, 4), 0.25), torch.arange(8) % 4, 4)
    assert abs(float(uniform) - 1.0) < 1e-6, (
        f"load_balancing_loss: perfectly uniform routing over 4 experts should give 1.0, got "
        f"{float(uniform):.4g} (N times the sum over experts of f_i * P_i, N = 4)")
    collapsed = load_balancing_loss(F.one_hot(torch.zeros(6, dtype=torch.long), 4).float(),
                                    torch.zeros(6, dtype=torch.long), 4)
    assert abs(float(collapsed) - 4.0) < 1e-6, (
        f"every token and all probability on one of 4 experts should give 4.0, got {float(collapsed)}")
    probs = _probs(9, 4, 2).requires_grad_()
    indices = torch.topk(probs, 2, dim=-1).indices
    f = [sum(int(i == e) for i in indices.flatten()) / indices.numel() for e in range(4)]
    want = 4 * sum(f[e] * float(probs[:, e].detach().mean()) for e in range(4))
    got = load_balancing_loss(probs, indices, 4)
    value = got.item()
    assert got.requires_grad, (
        "load_balancing_loss (9 tokens, 4 experts, top-2, probabilities that require grad) "
        "returned a loss with no gradient: P_i, the mean router probability, must stay in the "
        "graph (no .detach(), .item() or torch.no_grad) — it is what trains the router")
    assert abs(value - want) < 1e-5, (
        f"top-2: N·Σ f_i·P_i with f = {[round(v, 3) for v in f]} (fractions of the 18 "
        f"assignments) should be {want:.5f}, got {value:.5f}")
    (grad,) = torch.autograd.grad(got, probs)
    want_grad = torch.tensor(f).expand(9, 4) * 4 / 9
    assert torch.allclose(grad, want_grad, atol=1e-6), (
        "the gradient should flow through P_i only (f_i is a count): "
        f"expected {want_grad[0].tolist()} in every row, got {grad[0].tolist()}")


def _expert_parallel_case():
    import torch.distributed as dist

    from minitrain.moe import ExpertParallelMoE, MoELayer

    rank = dist.get_rank()
    torch.manual_seed(0)
    local = MoELayer(6, 8, 4, top_k=2, capacity_factor=0.75)
    ep = ExpertParallelMoE.from_local(local)
    x = _tokens(10, 6, rank)
    want = local(x)
    return (ep(x) - want).abs().max().item(), local.last_routing.dropped_fraction


@pytest.mark.exercise("top_k_routing", points=2)
def test_your_functions_drive_expert_parallelism():
    results = launch(_expert_parallel_case, 2, timeout=60)
    for rank, (diff, dropped) in enumerate(results):
        assert dropped > 0, "the case should overflow the capacity"
        assert diff < 1e-5, (
            f"rank {rank}: the expert-parallel layer running on your top_k_routing, sort_by_expert "
            f"and unsort differs from the local layer by {diff:.3g} (with {dropped} assignments "
            f"over capacity dropped)")
