"""Graded tests of chapter 6: your f and g, your column- and row-parallel forward and your
vocabulary-parallel cross-entropy, each against the dense computation in plain torch.

Every case also counts the collectives your code calls (any of torch.distributed's), so an
answer that gathers whole weights or whole logits — a shortcut that skips the point of the
exercise — fails with a message saying which collective it called.
"""

from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minitrain.runtime import launch

ATOL = 1e-6  # fp32 sums in another order: a few rounding steps on values of order 1
NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
         "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast",
         "all_to_all", "all_to_all_single", "send", "recv", "all_gather_object")


def _largest(args) -> int:
    flat = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])]
    return max((t.numel() for t in flat if isinstance(t, torch.Tensor)), default=0)


def _kind(name: str) -> str:  # all_gather_into_tensor -> all_gather, and so on
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        if name.startswith(kind) and name != "all_gather_object":
            return kind
    return name


@contextmanager
def _counting():
    """Record (collective, elements of its largest tensor) for every call; still run it.
    A collective that calls another (a deprecated name its new one) is counted once."""
    calls, saved, depth = [], {n: getattr(dist, n) for n in NAMES if hasattr(dist, n)}, [0]
    for name, fn in saved.items():
        def counted(*args, _fn=fn, _name=name, **kwargs):
            if not depth[0]:
                calls.append((_kind(_name), _largest(list(args) + list(kwargs.values()))))
            depth[0] += 1
            try:
                return _fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        setattr(dist, name, counted)
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _same(x):  # the same tensor on every rank
    return torch.randn(x, generator=torch.Generator().manual_seed(5))


def _per_rank(shape, rank):
    return torch.randn(shape, generator=torch.Generator().manual_seed(50 + rank))


# ------------------------------------------------------------------------------ f and g
def _f_case():
    from minitrain.tensor_parallel.mappings import CopyToParallelRegion

    rank, world = dist.get_rank(), dist.get_world_size()
    x = _same((3, 4)).requires_grad_()
    with _counting() as forward_calls:
        y = CopyToParallelRegion.apply(x, None)
    with _counting() as backward_calls:
        y.backward(_per_rank((3, 4), rank))
    want = sum(_per_rank((3, 4), r) for r in range(world))
    return y.detach(), x.grad, want, forward_calls, backward_calls


def _r(values):  # a few values for a message, readably
    return [round(v, 4) for v in values]


@pytest.mark.exercise("CopyToParallelRegion", points=2)
def test_f_is_identity_forward_and_all_reduce_backward():
    for rank, (y, grad, want, fwd, bwd) in enumerate(launch(_f_case, 3, timeout=60)):
        assert torch.equal(y, _same((3, 4))), (
            f"CopyToParallelRegion (f): forward must return its input unchanged; rank {rank} got "
            f"{_r(y[0].tolist())}, its input starts {_r(_same((3, 4))[0].tolist())}")
        assert not fwd, f"f's forward must not communicate; it called {fwd}"
        assert grad is not None and torch.allclose(grad, want, atol=ATOL), (
            f"CopyToParallelRegion (f): backward must sum the gradient over the ranks: rank "
            f"{rank}'s x.grad starts "
            f"{None if grad is None else _r(grad[0].tolist())}, expected {_r(want[0].tolist())}")
        assert [n for n, _ in bwd] == ["all_reduce"], f"f's backward should call one all_reduce, it called {bwd}"


def _g_case():
    from minitrain.tensor_parallel.mappings import ReduceFromParallelRegion

    rank, world = dist.get_rank(), dist.get_world_size()
    x = _per_rank((3, 4), rank).requires_grad_()
    with _counting() as forward_calls:
        y = ReduceFromParallelRegion.apply(x, None)
    untouched = torch.equal(x.detach(), _per_rank((3, 4), rank))
    upstream = _same((3, 4))
    with _counting() as backward_calls:
        y.backward(upstream)
    want = sum(_per_rank((3, 4), r) for r in range(world))
    return y.detach(), want, untouched, x.grad, upstream, forward_calls, backward_calls


@pytest.mark.exercise("ReduceFromParallelRegion", points=2)
def test_g_is_all_reduce_forward_and_identity_backward():
    for rank, (y, want, untouched, grad, upstream, fwd, bwd) in enumerate(launch(_g_case, 3, timeout=60)):
        assert torch.allclose(y, want, atol=ATOL), (
            f"ReduceFromParallelRegion (g): forward must return the sum over ranks: rank {rank} "
            f"got {_r(y[0].tolist())}, "
            f"expected {_r(want[0].tolist())}")
        assert untouched, "g's forward must not modify its input (all-reduce a copy)"
        assert grad is not None and torch.equal(grad, upstream), (
            f"ReduceFromParallelRegion (g): backward must pass the gradient through unchanged: "
            f"rank {rank} got "
            f"{None if grad is None else _r(grad[0].tolist())}, expected {_r(upstream[0].tolist())}")
        assert not bwd, f"g's backward must not communicate; it called {bwd}"
        assert [n for n, _ in fwd] == ["all_reduce"], f"g's forward should call one all_reduce, it called {fwd}"


# ------------------------------------------------------------------------- the Linears
def _dense(i, o):
    torch.manual_seed(11)
    return nn.Linear(i, o)


def _linear_case(kind, options, x_shape, shard_dim):
    """Run the sharded layer on this rank's input; return its output and gradients next to
    the dense layer's (sliced as this rank should hold them)."""
    from minitrain.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    rank, world = dist.get_rank(), dist.get_world_size()
    dense = _dense(x_shape[-1], 8)
    cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
    layer = cls.from_linear(dense, **options)
    x_full = _same(x_shape).requires_grad_()
    y_full = dense(x_full)
    upstream = torch.randn(y_full.shape, generator=torch.Generator().manual_seed(9))
    y_full.backward(upstream)
    x = x_full.detach()
    if shard_dim is not None:
        x = x.chunk(world, shard_dim)[rank]
    x = x.clone().requires_grad_()
    with _counting() as calls:
        try:
            y = layer(x)
        except NotImplementedError:
            raise
        except RuntimeError as exc:  # torch's shape error names neither the layer nor the case
            raise AssertionError(
                f"{cls.__name__}.forward {options} on {world} ranks, this rank's input of shape "
                f"{tuple(x.shape)}, weight shard {tuple(layer.weight.shape)}: "
                f"{str(exc).splitlines()[0]} — is the input split (or gathered) as the options "
                f"say before the matmul?") from None
    want = y_full.detach()
    up = upstream
    for d in range(want.dim()):  # this rank's slice of the dense output, if it holds one
        if y.shape[d] != want.shape[d]:
            want, up = want.chunk(world, d)[rank], up.chunk(world, d)[rank]
    if y.shape != want.shape:
        return ("shape", tuple(y.shape), tuple(want.shape), calls)
    y.backward(up)
    x_grad_want = x_full.grad if shard_dim is None else x_full.grad.chunk(world, shard_dim)[rank]
    checks = {
        "output": ((y - want).abs().max().item(), y[0, 0, :4].tolist(), want[0, 0, :4].tolist()),
        "input gradient": ((x.grad - x_grad_want).abs().max().item(),
                           x.grad.flatten()[:4].tolist(), x_grad_want.flatten()[:4].tolist()),
    }
    for name in ("weight", "bias"):
        got, full = getattr(layer, name).grad, getattr(dense, name).grad
        for d in range(full.dim()):
            if got.shape[d] != full.shape[d]:
                full = full.chunk(world, d)[rank]
        checks[name + " gradient"] = ((got - full).abs().max().item(), got.flatten()[:4].tolist(),
                                      full.flatten()[:4].tolist())
    return ("ok", checks, calls)


def _check_linear(kind, options, x_shape, shard_dim, allowed):
    for rank, result in enumerate(launch(_linear_case, 2, kind, options, x_shape, shard_dim, timeout=60)):
        if result[0] == "shape":
            raise AssertionError(
                f"{kind.capitalize()}ParallelLinear.forward {options} on 2 ranks: rank {rank}'s "
                f"output has shape {result[1]}, expected {result[2]}")
        _, checks, calls = result
        for what, (err, got, want) in checks.items():
            assert err <= ATOL, (
                f"{kind.capitalize()}ParallelLinear {options}: rank {rank}'s {what} differs from "
                f"the dense layer's by {err:.3g}; it starts {_r(got)}, the dense layer's {_r(want)}")
        names = [n for n, _ in calls]
        assert names == allowed, (
            f"{kind.capitalize()}ParallelLinear.forward {options} should call {allowed or 'no collective'}, "
            f"it called {names}")


@pytest.mark.exercise("ColumnParallelLinear.forward", points=3)
@pytest.mark.parametrize("options,x_shape,shard_dim,allowed", [
    ({}, (2, 4, 6), None, []),  # f: nothing forward, the all-reduce comes in backward
    ({"gather_output": True}, (2, 4, 6), None, ["all_gather"]),
    ({"sequence_parallel": True}, (2, 4, 6), 1, ["all_gather"]),
], ids=["sharded-output", "gather_output", "sequence_parallel"])
def test_column_parallel_forward(options, x_shape, shard_dim, allowed):
    _check_linear("column", options, x_shape, shard_dim, allowed)


@pytest.mark.exercise("RowParallelLinear.forward", points=3)
@pytest.mark.parametrize("options,x_shape,shard_dim,allowed", [
    ({}, (2, 4, 6), -1, ["all_reduce"]),
    ({"input_is_parallel": False}, (2, 4, 6), None, ["all_reduce"]),
    ({"sequence_parallel": True}, (2, 4, 6), -1, ["reduce_scatter"]),
], ids=["parallel-input", "full-input", "sequence_parallel"])
def test_row_parallel_forward(options, x_shape, shard_dim, allowed):
    _check_linear("row", options, x_shape, shard_dim, allowed)


# ------------------------------------------------------------------- the cross-entropy
def _ce_case(scale, backward=True, world_tokens=(4, 6)):
    from minitrain.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(3)
    full = (torch.randn(*world_tokens, 24, generator=g) * scale).requires_grad_()
    targets = torch.randint(0, 24, world_tokens, generator=g)
    want = F.cross_entropy(full.reshape(-1, 24), targets.reshape(-1))
    want.backward()
    shard = full.detach().chunk(world, -1)[rank].clone().requires_grad_()
    with _counting() as forward_calls:
        loss = VocabParallelCrossEntropy.apply(shard, targets, None)
    backward_calls = []
    if backward:  # the value test stops here, so an unwritten backward cannot fail it
        with _counting() as backward_calls:
            loss.backward()
    grad_want = full.grad.chunk(world, -1)[rank]
    return (loss.item(), want.item(), shard.grad, grad_want, forward_calls, backward_calls,
            targets.numel())


@pytest.mark.exercise("VocabParallelCrossEntropy.forward", points=3)
@pytest.mark.parametrize("scale", [1.0, 1e4], ids=["logits~1", "logits~1e4"])
def test_vocab_parallel_cross_entropy_value(scale):
    for rank, (loss, want, *_, fwd, _, tokens) in enumerate(launch(_ce_case, 3, scale, False, timeout=60)):
        too_big = [(n, k) for n, k in fwd if n != "all_reduce" or k > tokens]
        assert not too_big, (
            f"the loss must be found without gathering the logits: only all-reduces of one "
            f"number per token ({tokens}) are needed, but forward called {too_big}")
        assert abs(loss - want) <= 1e-6 * max(1.0, abs(want)), (
            f"VocabParallelCrossEntropy.forward, logits of size ~{scale:g}: rank {rank}'s loss "
            f"is {loss:.7g}, F.cross_entropy on the whole logits gives {want:.7g} (the max, the "
            f"sum of exps and the target's logit are each over all ranks' shards)")


@pytest.mark.exercise("VocabParallelCrossEntropy.backward", points=3)
@pytest.mark.parametrize("scale", [1.0, 1e4], ids=["logits~1", "logits~1e4"])
def test_vocab_parallel_cross_entropy_gradient(scale):
    for rank, (*_, grad, want, _, bwd, _) in enumerate(launch(_ce_case, 3, scale, timeout=60)):
        err = (grad - want).abs() if grad is not None and grad.shape == want.shape else None
        at = tuple(int(i) for i in (err == err.max()).nonzero()[0]) if err is not None else None
        assert grad is not None and torch.allclose(grad, want, atol=1e-7), (
            f"VocabParallelCrossEntropy.backward, logits of size ~{scale:g}: rank {rank}'s "
            + ("gradient is None" if grad is None else
               f"gradient has shape {tuple(grad.shape)}, expected {tuple(want.shape)}" if at is None
               else f"gradient differs from F.cross_entropy's by up to {err.max().item():.3g}; at "
               f"{at} yours is {grad[at].item():.4g}, F.cross_entropy's {want[at].item():.4g} "
               f"(the loss is a mean over {want.shape[0] * want.shape[1]} tokens)"))
        assert not bwd, f"backward needs no communication (softmax - onehot), it called {bwd}"
