"""The course's GPT made tensor-parallel, in place, from one table: ``apply_tensor_parallel``.

Used by notebooks/06_tensor_parallel.ipynb. ``PLAN`` below is Megatron-LM's layout (Shoeybi
et al. 2019, section 3, Figures 3 and 4) written as data, as torchtitan writes its
"parallelize plan": which module of the GPT becomes which parallel module.

- attention: q, k, v column-parallel (rank r keeps heads r*a/t .. (r+1)*a/t, whole heads
  since CausalSelfAttention reads the number of heads from the projected width), out_proj
  row-parallel: one all-reduce forward (g), one backward (f);
- MLP: fc_in column-parallel, GELU on the local slice, fc_out row-parallel: the same;
- token embedding vocab-parallel, LM head column-parallel feeding
  ``vocab_parallel_cross_entropy``: the logits are never gathered.

With ``sequence_parallel=True`` (Korthikanti et al. 2022, section 4.2.2) the residual
stream between sub-blocks is a 1/t shard of the sequence on each rank: the rows marked SP
apply too, and f/g become all-gather / reduce-scatter. A LayerNorm's parameters (and the
position table) are replicated but see only a shard, so their gradients must be summed
across the group — the classic bug is to forget it; here they enter through f, whose
backward does the sum: one small all-reduce per parameter per use (per block: two LayerNorms'
gain and bias, plus the two row biases added on a shard), during backward. Megatron-LM instead
marks these parameters and all-reduces their gradients once per step, coalesced into one
message, after backward (``finalize_model_grads``): the same bytes in one message instead of
6 per block (+ ln_f's 2 and the position table's 1). Kept per use here because it needs no
step hook: the gradients are complete when backward returns, so clipping, ZeRO/DP and the
trainer see them as they see every other gradient.

``apply_tensor_parallel`` walks the table and puts a new module, built from the dense one,
where the dense one was (no object changes class): parameter names stay the dense model's and
a dense checkpoint maps onto the shards by name and slice. What changes in the GPT as a whole
goes through its extension points (minitrain.model): ``loss_fn``, ``shard_rng`` and, for keyed
dropout, ``dropout_keys.sequence_shard`` (each attention's ``first_head`` says its heads).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from minitrain.model import GPT, CausalSelfAttention, GPTConfig
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
    their gradients (partial: one shard's tokens) are summed across the group — here, in
    backward, one all-reduce per parameter per use (Megatron: once per step, coalesced)."""

    def __init__(self, normalized_shape, eps=1e-5, bias=True, group: ProcessGroup | None = None):
        super().__init__(normalized_shape, eps, bias=bias)
        self.group = group

    @classmethod
    def from_layernorm(cls, norm: nn.LayerNorm, group: ProcessGroup | None = None):
        """``norm`` on a shard: the same gain and bias (replicated, so kept, not copied)."""
        layer = cls(norm.normalized_shape, norm.eps, norm.bias is not None, group)
        layer.weight, layer.bias = norm.weight, norm.bias
        return layer

    def forward(self, x):
        weight = copy_to_parallel_region(self.weight, self.group)
        bias = None if self.bias is None else copy_to_parallel_region(self.bias, self.group)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class SequenceParallelPositionEmbedding(nn.Module):
    """The position table on a shard of the sequence: called with every position of the
    tokens (0..s-1, or under context parallelism the CP shard's, which sequence parallelism
    cuts further, as Megatron-Core cuts a CP shard over the TP ranks in the SP regions), it
    looks up this rank's contiguous 1/t of them: the tokens the embedding's reduce-scatter kept."""

    def __init__(self, weight: nn.Parameter, group: ProcessGroup | None = None):
        super().__init__()
        self.weight, self.group = weight, group

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: ProcessGroup | None = None):
        """The same table (replicated, so kept, not copied)."""
        return cls(embedding.weight, group)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        # this rank's positions (a copy: the lookup saves it for backward, and a view would
        # keep all s positions alive)
        pos = split(positions, 0, self.group).clone()
        # the table is replicated but each rank reads only its positions: f sums the table's
        # gradient across the group, as for the LayerNorms
        table = copy_to_parallel_region(self.weight, self.group)
        return F.embedding(pos, table)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]} x {self.weight.shape[1]} (this rank's positions)"


class TensorParallelAttention(CausalSelfAttention):
    """Attention over this rank's heads. The input enters the parallel region once for
    q, k and v (one f, or one sequence all-gather), not once per projection."""

    @classmethod
    def from_attention(cls, dense: CausalSelfAttention, config: GPTConfig,
                       group: ProcessGroup | None, sequence_parallel: bool,
                       rng: TensorParallelRNG) -> TensorParallelAttention:
        """``dense``'s projections (the plan splits them next), attention function and dropout
        (keyed dropout: its layer, and the global index of this rank's first head)."""
        with torch.device("meta"):  # placeholder Linears: no memory, no random numbers drawn
            attn = cls(config, dense.attention_fn, dense.layer, dense.dropout_keys)
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(attn, name, getattr(dense, name))
        attn.head_dim, attn.dropout = dense.head_dim, dense.dropout
        rank, t = group_rank_and_size(group)
        attn.first_head = rank * (config.n_head // t)  # rank r holds heads r·a/t .. (r+1)·a/t
        attn.group, attn.sequence_parallel, attn.rng = group, sequence_parallel, rng
        return attn.train(dense.training)

    def forward(self, x):
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.group)
        else:
            x = copy_to_parallel_region(x, self.group)
        with self.rng.fork(x.device):  # attention dropout: each rank drops its own heads
            return super().forward(x)


# ---------------------------------------------------------------------------- the plan
SP, ALWAYS = True, False  # a row for sequence parallelism only, or for every run

# What replaces each module of the course's GPT ("*": in every block), in the order applied.
PLAN = (
    # path                      style            only with SP?
    ("blocks.*.ln_1",          "sequence_norm",  SP),  # on this rank's tokens
    ("blocks.*.attn",          "attention",      ALWAYS),  # the input enters once for q, k, v
    ("blocks.*.attn.q_proj",   "column_entered", ALWAYS),  # this rank's heads
    ("blocks.*.attn.k_proj",   "column_entered", ALWAYS),
    ("blocks.*.attn.v_proj",   "column_entered", ALWAYS),
    ("blocks.*.attn.out_proj", "row",            ALWAYS),  # g (or a reduce-scatter), bias once
    ("blocks.*.ln_2",          "sequence_norm",  SP),
    ("blocks.*.mlp.fc_in",     "column",         ALWAYS),  # f (or an all-gather) in front
    ("blocks.*.mlp.fc_out",    "row",            ALWAYS),
    ("ln_f",                   "sequence_norm",  SP),
    ("tok_emb",                "vocab",          ALWAYS),  # partial embeddings summed
    ("pos_emb",                "positions",      SP),  # this rank's positions
    ("head",                   "column",         ALWAYS),  # logits stay split: the loss is too
)


class Context(NamedTuple):
    """What every style needs besides the dense module."""

    group: ProcessGroup | None
    sequence_parallel: bool
    rng: TensorParallelRNG
    config: GPTConfig


# style -> the parallel module built from the dense one
STYLES = {
    "column": lambda m, c: ColumnParallelLinear.from_linear(
        m, c.group, sequence_parallel=c.sequence_parallel),
    # the input was entered once for q, k and v by the attention: no f of its own
    "column_entered": lambda m, c: ColumnParallelLinear.from_linear(
        m, c.group, communicate_input=False),
    "row": lambda m, c: RowParallelLinear.from_linear(
        m, c.group, sequence_parallel=c.sequence_parallel),
    "vocab": lambda m, c: VocabParallelEmbedding.from_embedding(
        m, c.group, sequence_parallel=c.sequence_parallel),
    "positions": lambda m, c: SequenceParallelPositionEmbedding.from_embedding(m, c.group),
    "sequence_norm": lambda m, c: SequenceParallelLayerNorm.from_layernorm(m, c.group),
    "attention": lambda m, c: TensorParallelAttention.from_attention(
        m, c.config, c.group, c.sequence_parallel, c.rng),
}


def modules_at(model: nn.Module, path: str) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every module ``path`` names; ``*`` is every element of a list."""
    *parents, name = path.split(".")
    holders = [model]
    for part in parents:
        holders = [c for h in holders for c in (list(h) if part == "*" else [getattr(h, part)])]
    return [(h, name) for h in holders]


def apply_tensor_parallel(model: GPT, group: ProcessGroup | None = None,
                          sequence_parallel: bool = False, seed: int | None = None) -> GPT:
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
    context = Context(group, sp, rng, config)
    for path, style, sp_only in PLAN:
        if sp_only and not sp:
            continue
        for parent, name in modules_at(model, path):
            if not hasattr(parent, name):  # a mixture of experts in place of the MLP
                continue  # (chapter 8) stays whole on every TP rank (chapter 11)
            setattr(parent, name, STYLES[style](getattr(parent, name), context))
    if config.tie_weights:  # both hold rows r*v/t .. of the same matrix: share them again
        model.head.weight = model.tok_emb.weight
    # the GPT's extension points: the loss of this rank's vocabulary slice of the logits and,
    # with SP, every dropout between embedding and head on this rank's stream (its shard)
    model.loss_fn = partial(vocab_parallel_cross_entropy, group=group)
    model.shard_rng = rng if sp else None
    if sp:  # keyed dropout: the residual stream holds this rank's contiguous 1/t of the positions
        model.dropout_keys.sequence_shard = (rank, t)
    model.tp_group, model.tp_size, model.sequence_parallel, model.tp_rng = group, t, sp, rng
    return model
