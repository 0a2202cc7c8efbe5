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
        ### BEGIN SOLUTION
        # HINT: remember the group on ctx for backward; every rank already holds all of x
        ctx.group = group
        return x.view_as(x)  # a view, not x itself: autograd wants a new output tensor
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        # HINT: each rank's grad is only its share: sum them with all_reduce(..., ctx.group)
        return all_reduce(grad.contiguous().clone(), ctx.group), None
        ### END SOLUTION


class ReduceFromParallelRegion:
    # Only the methods you write; the rest of the class is in minitrain.tensor_parallel.mappings.

    @staticmethod
    def forward(ctx, x, group):
        ### BEGIN SOLUTION
        # HINT: sum the partial outputs with all_reduce on a copy (never modify the input)
        return all_reduce(x.contiguous().clone(), group)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        # HINT: the sum's gradient is the same on every rank: pass it through
        return grad, None
        ### END SOLUTION


class ColumnParallelLinear:
    # Only the methods you write; the rest of the class is in minitrain.tensor_parallel.layers.

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ### BEGIN SOLUTION
        # HINT: enter with f (copy_to_parallel_region) or, if self.sequence_parallel, with
        # HINT: gather_from_sequence_parallel_region; skip both if not self.communicate_input
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
        ### BEGIN SOLUTION
        # HINT: split x if not self.input_is_parallel; multiply WITHOUT the bias; sum with g
        # HINT: (or reduce_scatter_to_sequence_parallel_region); then add the bias once
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
        ### BEGIN SOLUTION
        # HINT: 1) max over the vocabulary: local max, then all_reduce(m, group, dist.ReduceOp.MAX)
        # HINT: 2) sum of exp(z - max): local sum, then all_reduce; 3) the target's shifted logit
        # HINT: from the rank whose slice holds it (0 elsewhere), all_reduce. Save what backward needs.
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
        ### BEGIN SOLUTION
        # HINT: (softmax - onehot(target)) * grad_loss / number of tokens; the onehot's 1
        # HINT: only on the rank holding the target. No communication is needed.
        softmax, safe, mine = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, safe, -mine.unsqueeze(-1).to(grad.dtype))
        grad *= grad_loss / mine.numel()
        return grad.to(ctx.input_dtype), None, None
        ### END SOLUTION

# minitrain-exercises-hash: 9461af6baaf5a74f
