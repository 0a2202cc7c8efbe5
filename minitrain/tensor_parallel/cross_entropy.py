"""Cross-entropy over a vocabulary split across ranks, without gathering the logits.

The LM head is column-parallel: rank r holds the logits of its slice of the vocabulary,
(..., v/t). Gathering them would move b*s*v numbers; Megatron-LM (Shoeybi et al. 2019,
section 3: "fuse the output of the parallel GEMM with the cross entropy loss") moves
three numbers per token instead:

1. the max logit, all-reduced with MAX, subtracted for stability (logits of 1e4 would
   overflow exp otherwise);
2. the sum of exponentials, all-reduced with SUM: log of it is the log-partition;
3. the target's logit, which only the rank owning the target has (the others add 0).

loss_i = log(sum_j exp(z_ij - m_i)) - (z_i,target - m_i). Backward is written by hand:
d loss / d z = (softmax(z) - onehot(target)) / N, each rank computing its own columns.

Precision: computed in ``torch.promote_types(dtype, torch.float32)`` — bf16/fp16 logits go
up to fp32 (exp and the sum over the vocabulary need its range and digits), fp64 stays fp64
(an fp64 model gets fp64 accuracy, not fp32's 1e-7).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from minitrain.tensor_parallel.layers import group_rank_and_size
from minitrain.tensor_parallel.mappings import all_reduce


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits split along the vocabulary (the last dimension)."""

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


def vocab_parallel_cross_entropy(logits_shard, targets,
                                 group: ProcessGroup | None = None) -> torch.Tensor:
    """The mean cross-entropy of the *full* logits, rank r holding the r-th vocabulary slice
    of the last dimension; value and gradient equal ``F.cross_entropy`` on the gathered
    logits (flattened over every position)."""
    return VocabParallelCrossEntropy.apply(logits_shard, targets, group)
