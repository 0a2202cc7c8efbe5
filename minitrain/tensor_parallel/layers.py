"""Column- and row-parallel Linears and the vocabulary-parallel embedding.

Shoeybi et al. 2019 (Megatron-LM, section 3, Figure 3). One weight-layout convention: torch's
nn.Linear stores W as (out, in) and computes y = x W^T + b; Megatron writes Y = XA with A = W^T
(in, out). The names "column" and "row" are Megatron's, of A — so a column split of A is a row
split of torch's W, and a row split of A a column split of W. A Linear is split

- by *columns* of A, its output features (rank r holds rows r*o/t .. (r+1)*o/t of W and of
  b): each rank computes its slice of y from the whole x — the input enters through f;
- by *rows* of A, its input features (rank r holds columns r*i/t .. of W): each rank
  multiplies its slice of x and the partial products are summed by g. The bias is added
  once, *after* the sum — added on every rank before it, it would count t times.

Column then row (MLP: fc_in, fc_out; attention: q/k/v, out_proj) needs one all-reduce
forward and one backward per sub-block. With ``sequence_parallel=True`` (Korthikanti et
al. 2022, section 4.2.2) f becomes an all-gather of sequence shards and g a reduce-scatter.
Parameter names are nn.Linear's / nn.Embedding's, so a dense checkpoint maps onto the
shards by name and slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from minitrain.runtime import get_device
from minitrain.tensor_parallel.mappings import (
    copy_to_parallel_region,
    gather_from_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_parallel_region,
)


def group_rank_and_size(group: ProcessGroup | None = None) -> tuple[int, int]:
    """(this rank's index in the group, the group's size); (0, 1) without torch.distributed."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def divide(total: int, parts: int, what: str) -> int:
    """total // parts, or an error naming both numbers and what was being split."""
    if total % parts:
        raise ValueError(f"tensor parallel size {parts} does not divide {total} {what}")
    return total // parts



def factory_kwargs(device=None, dtype=None) -> dict:
    """``device=``/``dtype=`` for a layer's new parameters: built where they will live (this
    rank's device unless told), never on the CPU and moved after."""
    return {"device": torch.device(device) if device is not None else get_device(),
            "dtype": dtype}


def like(tensor: torch.Tensor) -> dict:
    """A shard is built on its dense tensor's device, in its dtype."""
    return {"device": tensor.device, "dtype": tensor.dtype}

class ColumnParallelLinear(nn.Module):
    """A Linear whose *output* features are split across the group (columns of Megatron's A,
    rows of torch's weight W).

    Input: replicated (or, with ``sequence_parallel``, this rank's sequence shard).
    Output: this rank's contiguous slice of the last dimension, or the whole output if
    ``gather_output``. ``communicate_input=False`` when the caller already passed the
    input through f (or the sequence all-gather) once for several layers reading it
    (q, k and v), so its gradient is summed once, not three times.
    """

    def __init__(self, in_features, out_features, bias=True, gather_output=False,
                 group: ProcessGroup | None = None, sequence_parallel=False,
                 communicate_input=True, device=None, dtype=None):
        super().__init__()
        new = factory_kwargs(device, dtype)
        rank, size = group_rank_and_size(group)
        self.group, self.rank, self.tp_size = group, rank, size
        self.in_features, self.out_features = in_features, out_features
        self.local_out = divide(out_features, size, "output features")
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.communicate_input = communicate_input
        self.weight = nn.Parameter(torch.empty(self.local_out, in_features, **new))
        self.bias = nn.Parameter(torch.zeros(self.local_out, **new)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: ProcessGroup | None = None,
                    **kwargs) -> ColumnParallelLinear:
        """Rank r's share of a dense Linear: rows r*o/t .. (r+1)*o/t of its weight and bias."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    group=group, **like(linear.weight), **kwargs)
        rows = slice(layer.rank * layer.local_out, (layer.rank + 1) * layer.local_out)
        with torch.no_grad():
            layer.weight.copy_(linear.weight[rows])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias[rows])
        return layer

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

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features} ({self.local_out} on this rank)"


class RowParallelLinear(nn.Module):
    """A Linear whose *input* features are split across the group (rows of Megatron's A,
    columns of torch's weight W); output summed.

    Input: this rank's slice of the last dimension (``input_is_parallel=True``, the
    column layer's output) or the whole input, which is then split here. Output: the full
    result, summed over ranks by g (or reduce-scattered along the sequence with
    ``sequence_parallel``); the bias, replicated, is added once after the sum.
    """

    def __init__(self, in_features, out_features, bias=True, input_is_parallel=True,
                 group: ProcessGroup | None = None, sequence_parallel=False, device=None,
                 dtype=None):
        super().__init__()
        new = factory_kwargs(device, dtype)
        rank, size = group_rank_and_size(group)
        self.group, self.rank, self.tp_size = group, rank, size
        self.in_features, self.out_features = in_features, out_features
        self.local_in = divide(in_features, size, "input features")
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in, **new))
        self.bias = nn.Parameter(torch.zeros(out_features, **new)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: ProcessGroup | None = None,
                    **kwargs) -> RowParallelLinear:
        """Rank r's share of a dense Linear: columns r*i/t .. (r+1)*i/t of its weight; the
        whole bias (every rank keeps it, only the sum gets it)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    group=group, **like(linear.weight), **kwargs)
        cols = slice(layer.rank * layer.local_in, (layer.rank + 1) * layer.local_in)
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, cols])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

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

    def extra_repr(self) -> str:
        return f"in={self.in_features} ({self.local_in} on this rank), out={self.out_features}"


class VocabParallelEmbedding(nn.Module):
    """An Embedding whose vocabulary rows are split: rank r holds rows r*v/t .. (r+1)*v/t.

    Each rank looks up the tokens it owns, writes zeros for the others (the masked rows),
    and the partial embeddings are summed across the group (Megatron-LM section 3): with
    ``sequence_parallel`` by a reduce-scatter along the sequence, so each rank keeps
    its shard of the sequence.
    """

    def __init__(self, num_embeddings, embedding_dim, group: ProcessGroup | None = None,
                 sequence_parallel=False, device=None, dtype=None):
        super().__init__()
        new = factory_kwargs(device, dtype)
        rank, size = group_rank_and_size(group)
        self.group, self.rank, self.tp_size = group, rank, size
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.local_rows = divide(num_embeddings, size, "vocabulary rows")
        self.start = rank * self.local_rows
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(torch.empty(self.local_rows, embedding_dim, **new))
        nn.init.normal_(self.weight, std=0.02)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: ProcessGroup | None = None, **kwargs):
        """Rank r's share of a dense Embedding: its contiguous slice of the vocabulary."""
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group=group,
                    **like(embedding.weight), **kwargs)
        with torch.no_grad():
            layer.weight.copy_(embedding.weight[layer.start : layer.start + layer.local_rows])
        return layer

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.start
        outside = (local < 0) | (local >= self.local_rows)
        # Look up row 0 for tokens another rank owns, then zero them: their gradient is 0.
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out * (~outside).unsqueeze(-1).to(out.dtype)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.group)
        return reduce_from_parallel_region(out, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} x {self.embedding_dim} (rows {self.start}.."\
               f"{self.start + self.local_rows - 1} on this rank)"
