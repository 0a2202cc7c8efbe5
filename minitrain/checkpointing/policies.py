"""Checkpointing policies on minitrain's GPT: which activations to forget and recompute.

Chapter 3, notebooks/03_activation_checkpointing.ipynb. "full" and "every_k" checkpoint
groups of blocks, "segments" is Chen et al. 2016's sqrt(L) split, "selective" recomputes
only the attention core (Korthikanti et al. 2022, section 5). The GPT lets us replace its
block loop (its ``block_loop`` attribute) and each attention's ``attention_fn`` without
copying the model.
"""

from __future__ import annotations

from torch import nn

from minitrain.checkpointing.cost import check_policy, segment_sizes
from minitrain.checkpointing.function import checkpoint, forward_states, run_in_order
from minitrain.model import CausalSelfAttention


class _CheckpointedAttention:
    """An ``attention_fn`` recomputing the attention core in backward (selective)."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, q, k, v, causal=True, dropout_p=0.0, training=False, dropout_site=None):
        if dropout_site is None:  # an inner attention_fn need not know keyed dropout
            return checkpoint(self.inner, q, k, v, causal, dropout_p, training)
        # the key is an argument: the recompute draws the forward's masks (minitrain.dropout)
        return checkpoint(self.inner, q, k, v, causal, dropout_p, training, dropout_site)


class BlocksInGroups:
    """A ``block_loop`` for the GPT (``(blocks, x) -> x``): the blocks in groups of ``sizes``,
    each group checkpointed (the last one only if ``last_checkpointed``)."""

    def __init__(self, sizes: list[int], last_checkpointed: bool):
        self.sizes, self.last_checkpointed = sizes, last_checkpointed

    def __call__(self, blocks, x):
        blocks, start = list(blocks), 0
        for i, size in enumerate(self.sizes):
            group = blocks[start : start + size]
            run = run_in_order(group)
            plain = i == len(self.sizes) - 1 and not self.last_checkpointed
            # the blocks' dropout streams and router statistics: replayed in the recompute
            x = run(x) if plain else checkpoint(run, x, states=forward_states(*group))
            start += size
        return x

    def __repr__(self) -> str:
        return f"BlocksInGroups(sizes={self.sizes}, last_checkpointed={self.last_checkpointed})"


def set_checkpointing(model: nn.Module, policy: str = "full", k: int = 1) -> nn.Module:
    """Apply a checkpointing policy to a GPT in place (replacing any previous one).

    - "none": store everything;
    - "full": checkpoint every block (Korthikanti et al.'s full recomputation);
    - "every_k": one checkpoint per group of ``k`` consecutive blocks, all groups
      (Megatron-LM's "uniform" method); k=1 is "full";
    - "segments": ``checkpoint_sequential`` of the blocks in ``k`` segments;
    - "selective": recompute only the attention core of every block.
    The model's parameters and ``state_dict`` are unchanged; ``set_checkpointing(model,
    "none")`` undoes it.
    """
    if not all(hasattr(model, n) for n in ("blocks", "block_loop")):
        raise TypeError(f"set_checkpointing needs minitrain's GPT, got {type(model).__name__}")
    check_policy(policy, k, len(model.blocks))
    model.block_loop = None  # the plain loop, unless the policy below sets its own
    for attn in model.modules():
        if isinstance(attn, CausalSelfAttention) and isinstance(
            attn.attention_fn, _CheckpointedAttention
        ):
            attn.attention_fn = attn.attention_fn.inner
    num_layers = len(model.blocks)
    if policy in ("full", "every_k"):
        size = 1 if policy == "full" else k
        sizes = [min(size, num_layers - s) for s in range(0, num_layers, size)]
        model.block_loop = BlocksInGroups(sizes, last_checkpointed=True)
    elif policy == "segments":
        sizes = segment_sizes(num_layers, k)
        model.block_loop = BlocksInGroups(sizes, last_checkpointed=False)
    elif policy == "selective":
        for attn in model.modules():
            if isinstance(attn, CausalSelfAttention):
                attn.attention_fn = _CheckpointedAttention(attn.attention_fn)
    return model
