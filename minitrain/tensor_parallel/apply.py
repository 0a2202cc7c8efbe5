"""The course's GPT made tensor-parallel, in place: ``apply_tensor_parallel(model, group)``.

Megatron-LM's layout (Shoeybi et al. 2019, section 3, Figure 3 and Figure 4):

- attention: q, k, v column-parallel (rank r keeps heads r*a/t .. (r+1)*a/t, whole heads
  since CausalSelfAttention reads the number of heads from the projected width), out_proj
  row-parallel: one all-reduce forward (g), one backward (f);
- MLP: fc_in column-parallel, GELU on the local slice, fc_out row-parallel: the same;
- token embedding vocab-parallel, LM head column-parallel feeding
  ``vocab_parallel_cross_entropy``: the logits are never gathered.

With ``sequence_parallel=True`` (Korthikanti et al. 2022, section 4.2.2) the residual
stream between sub-blocks is a 1/t shard of the sequence on each rank: LayerNorms and
dropout run on it, f/g become all-gather / reduce-scatter. A LayerNorm's parameters are
replicated but see only a shard, so their gradients must be summed across the group — the
classic bug is to forget it; here they enter through f, whose backward does the sum.

Module classes are swapped for subclasses (``__class__``), so parameter names stay the
dense model's and a dense checkpoint maps onto the shards by name and slice.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from minitrain.model import GPT, CausalSelfAttention, dropout
from minitrain.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from minitrain.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    divide,
    group_rank_and_size,
)
from minitrain.tensor_parallel.mappings import (
    copy_to_parallel_region,
    gather_from_sequence_parallel_region,
    split,
)
from minitrain.tensor_parallel.random import TensorParallelRNG


class SequenceParallelLayerNorm(nn.LayerNorm):
    """A LayerNorm run on a shard of the sequence: its gain and bias enter through f, so
    their gradients (partial: one shard's tokens) are summed across the group."""

    def forward(self, x):
        weight = copy_to_parallel_region(self.weight, self.group)
        bias = None if self.bias is None else copy_to_parallel_region(self.bias, self.group)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class TensorParallelAttention(CausalSelfAttention):
    """Attention over this rank's heads. The input enters the parallel region once for
    q, k and v (one f, or one sequence all-gather), not once per projection."""

    def forward(self, x):
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.group)
        else:
            x = copy_to_parallel_region(x, self.group)
        with self.rng.fork(x.device):  # attention dropout: each rank drops its own heads
            return super().forward(x)


class TensorParallelGPT(GPT):
    """The GPT after ``apply_tensor_parallel``: ``model(idx)`` returns this rank's
    vocabulary slice of the logits; ``model.loss(idx, targets)`` the full loss."""

    def embed(self, idx, positions=None):
        """``positions``: where ``idx``'s tokens sit (default 0..s-1; under context
        parallelism the CP shard's, which sequence parallelism cuts further, as Megatron-Core
        cuts a CP shard over the TP ranks in the SP regions)."""
        if not self.sequence_parallel:
            return super().embed(idx, positions)  # tok_emb all-reduces its partial embeddings
        s = idx.shape[1]
        divide(s, self.tp_size, "positions of the sequence (sequence parallelism)")
        x = self.tok_emb(idx)  # reduce-scattered: this rank's shard of the sequence
        if positions is None:
            positions = torch.arange(s, device=idx.device)
        # this rank's positions: its contiguous 1/t of them, the rows tok_emb kept (a copy:
        # the lookup saves it for backward, and a view would keep all s positions alive)
        pos = split(positions, 0, self.tp_group).clone()
        # the position table is replicated but each rank reads only its positions: f sums
        # the table's gradient across the group, as for the LayerNorms
        table = copy_to_parallel_region(self.pos_emb.weight, self.tp_group)
        return dropout(x + F.embedding(pos, table), self.config.dropout, self.training)

    def forward(self, idx, positions=None):
        # with sequence parallelism every dropout acts on distinct shards: per-rank stream
        shards = self.tp_rng.fork(idx.device) if self.sequence_parallel else nullcontext()
        with shards:
            x = self.run_blocks(self.embed(idx, positions))
        return self.logits(x)  # the column-parallel head: (b, s, v/t)

    def loss(self, idx, targets):
        return vocab_parallel_cross_entropy(self(idx), targets, self.tp_group)


def _to_sequence_parallel(norm: nn.LayerNorm, group) -> None:
    norm.__class__, norm.group = SequenceParallelLayerNorm, group


def apply_tensor_parallel(model: GPT, group=None, sequence_parallel: bool = False, seed=None):
    """Turn the course's GPT into its tensor-parallel version in place; returns it.

    Every rank must call it on the same dense model (same seed): rank r keeps its
    contiguous slice of each split parameter. ``seed`` (default: torch's initial seed)
    seeds the per-rank dropout stream. Raises ValueError naming the numbers when the group
    size does not divide n_head, d_ff or vocab_size.
    """
    config = model.config
    rank, t = group_rank_and_size(group)
    divide(config.n_head, t, "attention heads")
    divide(config.d_ff, t, "MLP hidden units (d_ff)")
    divide(config.vocab_size, t, "vocabulary entries")
    sp = sequence_parallel
    rng = TensorParallelRNG(torch.initial_seed() if seed is None else seed, rank)
    for block in model.blocks:
        attn = block.attn
        for name in ("q_proj", "k_proj", "v_proj"):
            dense = getattr(attn, name)
            setattr(attn, name, ColumnParallelLinear.from_linear(dense, group, communicate_input=False))
        attn.out_proj = RowParallelLinear.from_linear(attn.out_proj, group, sequence_parallel=sp)
        attn.__class__, attn.group, attn.sequence_parallel, attn.rng = (
            TensorParallelAttention, group, sp, rng)
        mlp = block.mlp
        mlp.fc_in = ColumnParallelLinear.from_linear(mlp.fc_in, group, sequence_parallel=sp)
        mlp.fc_out = RowParallelLinear.from_linear(mlp.fc_out, group, sequence_parallel=sp)
        if sp:
            _to_sequence_parallel(block.ln_1, group)
            _to_sequence_parallel(block.ln_2, group)
    if sp:
        _to_sequence_parallel(model.ln_f, group)
    model.tok_emb = VocabParallelEmbedding.from_embedding(model.tok_emb, group, sequence_parallel=sp)
    model.head = ColumnParallelLinear.from_linear(model.head, group, sequence_parallel=sp)
    if config.tie_weights:  # both hold rows r*v/t .. of the same matrix: share them again
        model.head.weight = model.tok_emb.weight
    model.__class__ = TensorParallelGPT
    model.tp_group, model.tp_size, model.sequence_parallel, model.tp_rng = group, t, sp, rng
    return model
