"""The conjugate communication operators of tensor parallelism, as autograd Functions.

Shoeybi et al. 2019 ("Megatron-LM", section 3, Figure 3) split a transformer's matrices
across ranks and need only two operators, each the other's mirror image:

- f: identity in forward, all-reduce in backward (enters a parallel region: every rank
  reads the same input, so the input's gradient is the *sum* of the ranks' partial ones);
- g: all-reduce in forward, identity in backward (leaves it: the ranks' partial outputs
  are summed; the sum's gradient reaches every rank unchanged).

Split / gather along the last dimension are the same idea for a sharded output.
Korthikanti et al. 2022 (section 4.2.2, "sequence parallelism") replace each all-reduce
by a reduce-scatter along the sequence plus an all-gather: the same bytes on a ring, but
LayerNorm and dropout then run on a 1/t shard of the sequence. Their pair is
all-gather forward / reduce-scatter backward (before a column-parallel layer), and its
conjugate reduce-scatter forward / all-gather backward (after a row-parallel layer).

Every collective goes through ``all_reduce``, ``all_gather`` or ``reduce_scatter`` below,
which log the *logical* message (gloo emulates some collectives; we count what the
algorithm asks for) and record a "communication" span for minitrain.runtime.trace.
With one rank every operator is the identity and nothing is logged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from minitrain.runtime import trace
from minitrain.runtime.communication_log import COMMUNICATION_LOG

SEQUENCE_DIM = 1  # the course's activations are (batch, sequence, hidden)

# Every collective below is recorded in the runtime's one communication log: bytes of the
# logical message, and bytes one rank sends on a ring, following chapter 4: an all-reduce
# sends 2(t-1)/t of the message, an all-gather or a reduce-scatter (t-1)/t of the full tensor.
SOURCE = "tp"


def communication_log() -> list[tuple[str, int, int]]:
    """The collectives run in this process since the last reset: (name, message bytes,
    ring bytes sent per rank)."""
    return [(r.kind, r.message_bytes, r.sent_bytes) for r in COMMUNICATION_LOG.records(SOURCE)]


def reset_communication_log() -> None:
    COMMUNICATION_LOG.reset(SOURCE)


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _record(name: str, full: torch.Tensor, ring_factor: float, group) -> None:
    t = _world(group)
    message = full.numel() * full.element_size()
    COMMUNICATION_LOG.record(SOURCE, name, round(ring_factor * (t - 1) / t * message), message, t)


def all_reduce(tensor: torch.Tensor, group: ProcessGroup | None = None,
               op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Sum (or ``op``) ``tensor`` over the group, in place; returns it."""
    if _world(group) == 1:
        return tensor
    with trace.span("all-reduce", "communication"):
        dist.all_reduce(tensor, op=op, group=group)
    _record("all-reduce", tensor, 2, group)
    return tensor


def all_gather(tensor: torch.Tensor, dim: int, group: ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` (rank order)."""
    t = _world(group)
    if t == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(t)]
    with trace.span("all-gather", "communication"):
        dist.all_gather(parts, tensor.contiguous(), group=group)
    full = torch.cat(parts, dim=dim)
    _record("all-gather", full, 1, group)
    return full


def reduce_scatter(tensor: torch.Tensor, dim: int,
                   group: ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``tensor`` over the group and keep this rank's contiguous slice along ``dim``."""
    t = _world(group)
    if t == 1:
        return tensor
    if tensor.shape[dim] % t:
        raise ValueError(f"reduce-scatter: size {tensor.shape[dim]} is not divisible by {t} ranks")
    moved = tensor.movedim(dim, 0).contiguous()  # the collective splits dimension 0
    out = torch.empty_like(moved[: moved.shape[0] // t])
    with trace.span("reduce-scatter", "communication"):
        # torch 2.13 renamed the tensor form; older versions have only the old name
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(
            out, moved, group=group
        )
    _record("reduce-scatter", tensor, 1, group)
    return out.movedim(0, dim)


def split(tensor: torch.Tensor, dim: int, group: ProcessGroup | None = None) -> torch.Tensor:
    """This rank's contiguous slice of ``tensor`` along ``dim`` (no communication)."""
    t = _world(group)
    if t == 1:
        return tensor
    if tensor.shape[dim] % t:
        raise ValueError(f"size {tensor.shape[dim]} along dim {dim} is not divisible by {t} ranks")
    return tensor.chunk(t, dim=dim)[dist.get_rank(group)].contiguous()


# ----------------------------------------------------------------- Megatron's f and g
class CopyToParallelRegion(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward (Figure 3)."""

    @staticmethod
    def forward(ctx, x, group):
        """f's forward: ``x`` (any shape and dtype, the same on every rank of ``group``) enters
        the parallel region unchanged. Returns a tensor equal to ``x`` — a new tensor object
        (a view will do), since autograd records a new output for a Function. Keep ``group``
        on ``ctx`` for backward. No communication here: every rank already holds all of x.
        """
        ### BEGIN SOLUTION
        ctx.group = group
        return x.view_as(x)  # a view, not x itself: autograd wants a new output tensor
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        """f's backward: ``grad`` (x's shape) is the gradient of *this rank's* use of x — each
        rank's layer reads all of x but only computes part of the output, so the true
        gradient of x is the sum over ranks. Returns one gradient per forward input:
        ``(gradient of x, None)`` (``group`` has none). May use ``all_reduce(tensor, group)``
        (sums in place and returns it — so give it a tensor you own, never ``grad`` itself,
        which autograd may share) and ``ctx.group``.
        """
        ### BEGIN SOLUTION
        return all_reduce(grad.contiguous().clone(), ctx.group), None
        ### END SOLUTION


class ReduceFromParallelRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward (Figure 3): f's conjugate."""

    @staticmethod
    def forward(ctx, x, group):
        """g's forward: ``x`` is this rank's partial result (e.g. a row-parallel Linear's
        product of its slice of the input); returns the sum over the ranks of ``group``, the
        same on every rank, x's shape and dtype. ``x`` itself must stay unchanged (autograd
        may have saved it). May use ``all_reduce(tensor, group)``.
        """
        ### BEGIN SOLUTION
        return all_reduce(x.contiguous().clone(), group)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        """g's backward: ``grad`` is the gradient of the summed output, already the same on
        every rank. Returns ``(gradient of x, None)``. Why no communication: the output is
        x_0 + ... + x_{t-1}, so d(out)/d(x_r) is the identity for every r.
        """
        ### BEGIN SOLUTION
        return grad, None
        ### END SOLUTION


class _Conjugates(torch.autograd.Function):
    """``forward_op`` on the input, its conjugate ``backward_op`` on the gradient.

    The pairs along a dimension are all of this shape: split / all-gather (each rank used
    only its slice), all-gather / reduce-scatter (each rank used the whole gathered tensor,
    so a slice's gradient is the sum of the ranks' contributions), and the reverses.
    """

    @staticmethod
    def forward(ctx, x, dim, group, forward_op, backward_op):
        ctx.dim, ctx.group, ctx.backward_op = dim, group, backward_op
        return forward_op(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad.contiguous(), ctx.dim, ctx.group), None, None, None, None


# ----------------------------------------------------------------- the names layers use
def copy_to_parallel_region(x, group: ProcessGroup | None = None):
    """f (Megatron-LM Figure 3): identity forward, all-reduce backward."""
    return CopyToParallelRegion.apply(x, group) if _world(group) > 1 else x


def reduce_from_parallel_region(x, group: ProcessGroup | None = None):
    """g (Megatron-LM Figure 3): all-reduce forward, identity backward."""
    return ReduceFromParallelRegion.apply(x, group) if _world(group) > 1 else x


def scatter_to_parallel_region(x, group: ProcessGroup | None = None):
    """Keep this rank's slice of the last dimension; backward gathers the gradient."""
    return _Conjugates.apply(x, -1, group, split, all_gather) if _world(group) > 1 else x


def gather_from_parallel_region(x, group: ProcessGroup | None = None):
    """Concatenate the ranks' slices of the last dimension; backward keeps this rank's."""
    return _Conjugates.apply(x, -1, group, all_gather, split) if _world(group) > 1 else x


def gather_from_sequence_parallel_region(x, group: ProcessGroup | None = None):
    """Sequence parallelism's entry (Korthikanti et al. §4.2.2): all-gather the sequence
    shards forward, reduce-scatter the gradient backward."""
    if _world(group) == 1:
        return x
    return _Conjugates.apply(x, SEQUENCE_DIM, group, all_gather, reduce_scatter)


def reduce_scatter_to_sequence_parallel_region(x, group: ProcessGroup | None = None):
    """Its conjugate, the exit: reduce-scatter along the sequence forward, all-gather
    the gradient backward."""
    if _world(group) == 1:
        return x
    return _Conjugates.apply(x, SEQUENCE_DIM, group, reduce_scatter, all_gather)


def scatter_to_sequence_parallel_region(x, group: ProcessGroup | None = None):
    """Keep this rank's shard of the sequence; backward all-gathers the gradient."""
    if _world(group) == 1:
        return x
    return _Conjugates.apply(x, SEQUENCE_DIM, group, split, all_gather)
