"""The course's GPT trained with its sequence split over a context-parallel group.

Used by notebooks/10_context_parallel.ipynb. Everything in the GPT except attention works
token by token, so with the sequence cut into shards (``layout.shard_sequence``) each rank
runs the embeddings, LayerNorms, MLPs and the head on its own tokens; only attention needs
the other ranks' keys and values, and ring attention brings them. Three things change:

1. positions: rank r's tokens are not at positions 0..n-1 but where its chunks sit in the
   sequence (``shard_positions``), so the position embedding is looked up there;
2. the loss: each rank's mean over its n tokens; the sequence's mean is their average
   over the group (every shard has the same number of tokens);
3. gradients, averaged — and why that is the sum of partial gradients: the loss is the mean
   over all N tokens, L = (1/P)·Σ_r loss_r. Each rank's backward sends dK, dV home, so rank
   s's gradient g_s holds every rank's loss, but only through *its own* tokens' activations:
   a partial gradient (in data parallelism each rank's is a whole one, of other sequences).
   Summed over the group, Σ_s g_s = Σ_r ∂loss_r/∂θ = P·∂L/∂θ, so the gradient of L is the
   group's average of g_s — the sum of the partial gradients of L itself. One all-reduce and
   a division by P (as data parallelism does, over the same group; Megatron-LM folds CP into
   its data-parallel gradient reduction). Summing without the division gives P·∂L/∂θ, which
   AdamW's scale-free step m/(√v + ε) nearly hides: notebook 10 checks the gradient itself.
   Every shard has as many tokens here; with padded or masked tokens the ranks would sum
   their token losses and divide by the group's count, not average their means.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from minitrain.context_parallel.gathered import gathered_attention
from minitrain.context_parallel.layout import shard_positions, shard_sequence
from minitrain.context_parallel.ring import ring_attention
from minitrain.model import GPT, lm_loss, set_attention_fn


class ContextParallelGPT(nn.Module):
    """Wraps a ``GPT`` (``.module``) so it runs on this rank's shard of each sequence.

    ``forward(idx_shard)`` gives this rank's logits; ``loss(idx_shard, targets_shard)``
    this rank's mean loss (backward it on every rank); ``average_loss(loss)`` the group's
    mean (the whole sequence's loss); ``finish_gradient_synchronization()`` averages every
    parameter's gradient over the group (call it after backward, before the optimizer).
    ``shard(x)`` cuts a whole ``(batch, N)`` tensor into this rank's shard, ``positions(x)``
    says where a shard's tokens sit (``module(x, positions=...)`` is this rank's forward).
    Attention dropout needs a dropout key (``module.dropout_keys``, minitrain.dropout: chapter
    11's trainer sets one): ring attention's tiles have no mask, so with dropout on the
    probabilities the keys and values are gathered instead (``gathered.py``).
    """

    def __init__(self, module: GPT, group: ProcessGroup | None = None, layout: str = "contiguous"):
        super().__init__()
        self.module, self.group, self.layout = module, group, layout
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        for p in module.parameters():  # every rank starts from rank 0's weights
            dist.broadcast(p.data, dist.get_global_rank(group, 0) if group else 0, group=group)

        def attention(q, k, v, causal=True, dropout_p=0.0, training=False, dropout_site=None):
            if dropout_p > 0 and training:
                if dropout_site is None:  # an unkeyed mask would not be one process's anyway
                    raise ValueError(f"ring attention has no attention dropout (dropout_p="
                                     f"{dropout_p}); with a dropout key set (minitrain.dropout, "
                                     "as ParallelGPT sets one) K and V are gathered instead")
                return gathered_attention(q, k, v, causal, dropout_p, dropout_site, group, layout)
            return ring_attention(q, k, v, causal=causal, group=group, layout=layout)

        set_attention_fn(module, attention)

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a ``(batch, N)`` tensor (the sequence is dimension -1)."""
        return shard_sequence(x.unsqueeze(-1), self.group, self.layout).squeeze(-1)

    def positions(self, idx: torch.Tensor) -> torch.Tensor:
        """Where this rank's tokens (``idx``, its ``(batch, n)`` shard) sit in the whole
        sequence of n·P positions. The GPT takes them as an argument (``module(idx,
        positions=...)``), so a composition passes them on (chapter 11) rather than replacing
        the GPT's embedding; a tensor-parallel module with sequence parallelism keeps its 1/t
        of them, so CP composes with TP + SP."""
        seq_len = idx.shape[1] * self.world_size
        if seq_len > self.module.config.seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds "
                             f"config.seq_len={self.module.config.seq_len}")
        pos = shard_positions(seq_len, self.rank, self.world_size, self.layout, device=idx.device)
        return pos

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """The module's own embedding at this shard's positions."""
        return self.module.embed(idx, self.positions(idx))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.module(idx, positions=self.positions(idx))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(self(idx), targets)

    def average_loss(self, loss: torch.Tensor) -> float:
        # summed in fp32 or wider (a bf16 sum over the ranks would round), fp64 stays fp64
        value = loss.detach().to(torch.promote_types(loss.dtype, torch.float32), copy=True)
        dist.all_reduce(value, group=self.group)
        return value.item() / self.world_size

    def finish_gradient_synchronization(self) -> None:
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)
                p.grad /= self.world_size
