"""Chapter 6 solutions — generated from minitrain.tensor_parallel.mappings, minitrain.tensor_parallel.layers, minitrain.tensor_parallel.cross_entropy.

The worked answers. Look one up when you are stuck; the library has them too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from minitrain.runtime import get_device, trace
from minitrain.runtime.communication_log import COMMUNICATION_LOG
from minitrain.tensor_parallel.layers import group_rank_and_size
from minitrain.tensor_parallel.mappings import all_reduce, copy_to_parallel_region, gather_from_parallel_region, gather_from_sequence_parallel_region, reduce_from_parallel_region, reduce_scatter_to_sequence_parallel_region, scatter_to_parallel_region


class CopyToParallelRegion:
    # Only the methods you write; the rest of the class is in minitrain.tensor_parallel.mappings.

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


class ReduceFromParallelRegion:
    # Only the methods you write; the rest of the class is in minitrain.tensor_parallel.mappings.

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


class ColumnParallelLinear:
    # Only the methods you write; the rest of the class is in minitrain.tensor_parallel.layers.

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (..., in_features), the same on every rank — or, with
        ``self.sequence_parallel``, this rank's shard of the sequence (dimension 0, the
        sequence-first layout of Korthikanti et al. 2022). Returns (..., local_out), this
        rank's contiguous slice of the output features — or all out_features, identical on
        every rank, if ``self.gather_output`` (what a head needs when its loss is not
        vocabulary-parallel).

        May use: ``self.weight`` (local_out, in_features), ``self.bias`` (local_out,) or
        None, ``self.group``, ``self.communicate_input``, ``self.sequence_parallel``,
        ``self.gather_output``, and the mappings ``copy_to_parallel_region`` (f),
        ``gather_from_sequence_parallel_region``, ``gather_from_parallel_region``.

        Requirements and why: the input enters the parallel region through f (its backward
        sums the input's gradient over the ranks, each of which used all of x) — or, with
        sequence parallelism, through the sequence all-gather, whose backward reduce-scatters;
        with ``communicate_input`` False the caller has done that once for several layers
        (q, k, v), and doing it again would sum the gradient twice.
        """
        ### BEGIN SOLUTION
        if self.communicate_input and self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.group)
        elif self.communicate_input:
            x = copy_to_parallel_region(x, self.group)
        y = F.linear(x, self.weight, self.bias)  # this rank's slice of the output features
        return gather_from_parallel_region(y, self.group) if self.gather_output else y
        ### END SOLUTION


class RowParallelLinear:
    # Only the methods you write; the rest of the class is in minitrain.tensor_parallel.layers.

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (..., local_in), this rank's slice of the input features (the column layer's
        output) when ``self.input_is_parallel``, else (..., in_features), the whole input,
        to be split here. Returns (..., out_features): the full product summed over the
        ranks, identical on every rank — or, with ``self.sequence_parallel``, this rank's
        shard of the sequence (dimension 0) of that sum.

        May use: ``self.weight`` (out_features, local_in), ``self.bias`` (out_features,) or
        None — whole on every rank, ``self.group``, ``self.input_is_parallel``,
        ``self.sequence_parallel``, and ``scatter_to_parallel_region``,
        ``reduce_from_parallel_region`` (g), ``reduce_scatter_to_sequence_parallel_region``,
        ``copy_to_parallel_region`` (f).

        Requirements and why: the bias is added once, after the sum (added on every rank
        before it, it would count t times). With sequence parallelism each rank adds the bias
        to its own sequence shard only, so each rank's bias gradient is partial: the bias must
        enter through f, whose backward sums that gradient over the ranks (else the replicas
        of the bias drift apart).
        """
        ### BEGIN SOLUTION
        if not self.input_is_parallel:
            x = scatter_to_parallel_region(x, self.group)
        partial = F.linear(x, self.weight)  # this rank's share of the sum; no bias yet
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial, self.group)
        else:
            y = reduce_from_parallel_region(partial, self.group)
        if self.bias is None:
            return y
        # With sequence parallelism each rank adds the bias to its own shard of the
        # sequence, so the bias's gradient is partial: f sums it across the group.
        bias = copy_to_parallel_region(self.bias, self.group) if self.sequence_parallel else self.bias
        return y + bias
        ### END SOLUTION


class VocabParallelCrossEntropy:
    # Only the methods you write; the rest of the class is in minitrain.tensor_parallel.cross_entropy.

    @staticmethod
    def forward(ctx, logits_shard, targets, group):
        """``logits_shard``: (..., v/t) this rank's slice of the vocabulary — rank r holds
        token ids r*v/t .. (r+1)*v/t - 1 — in any float dtype; ``targets``: (...) int64 ids
        of the whole vocabulary; ``group``: the tensor-parallel group. Returns the mean over
        all tokens of the cross-entropy, a 0-dim tensor in ``logits_shard``'s dtype, the same
        on every rank (equal to ``F.cross_entropy`` of the gathered logits).

        May use: ``group_rank_and_size(group)``, ``all_reduce(tensor, group, op)``
        (``dist.ReduceOp.MAX`` or the default sum; in place on what it is given), ``ctx``
        (``ctx.save_for_backward(...)``, attributes) for what backward needs.

        Requirements and why: never gather the logits (that is b*s*v numbers; three per
        token suffice — the module docstring lists them); subtract the *global* max, or the
        exponentials of large logits overflow and the ranks' sums do not add up; compute in
        ``torch.promote_types(dtype, torch.float32)`` (exp and a vocabulary-long sum need
        fp32's range and digits).
        """
        ### BEGIN SOLUTION
        rank, _ = group_rank_and_size(group)
        v_local = logits_shard.shape[-1]
        z = logits_shard.to(torch.promote_types(logits_shard.dtype, torch.float32))
        m = all_reduce(z.max(dim=-1).values, group, dist.ReduceOp.MAX)
        shifted = z - m.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = all_reduce(exp.sum(dim=-1), group)
        local_target = targets - rank * v_local
        mine = (local_target >= 0) & (local_target < v_local)  # tokens whose target I hold
        safe = local_target.masked_fill(~mine, 0).unsqueeze(-1)
        target_logit = shifted.gather(-1, safe).squeeze(-1) * mine
        target_logit = all_reduce(target_logit, group)
        loss = (sum_exp.log() - target_logit).mean()
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), safe, mine)
        ctx.input_dtype = logits_shard.dtype
        return loss.to(logits_shard.dtype)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad_loss):
        """``grad_loss``: the 0-dim gradient of the mean loss. Returns ``(gradient of
        logits_shard, None, None)`` — one per forward input; the first has
        ``logits_shard``'s shape and dtype: d loss / d z = (softmax(z) - onehot(target)) *
        grad_loss / N for this rank's columns, N the number of tokens (the loss is a mean).

        May use what forward saved (``ctx.saved_tensors``, attributes on ``ctx``). Why no
        communication: forward's sums made the softmax of this rank's columns exact, and the
        one-hot's 1 lies on the one rank that holds the target's column.
        """
        ### BEGIN SOLUTION
        softmax, safe, mine = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, safe, -mine.unsqueeze(-1).to(grad.dtype))
        grad *= grad_loss / mine.numel()
        return grad.to(ctx.input_dtype), None, None
        ### END SOLUTION

# minitrain-exercises-hash: d1673e859c544f6a
