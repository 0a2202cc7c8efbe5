"""Context-parallel attention *with* attention dropout: every rank's keys and values gathered.

Chapter 11 (where techniques meet). Ring attention (``ring.py``) computes each (query chunk,
key chunk) block with chapter 9's FlashAttention tiles, which have no dropout: a mask on the
probabilities would have to be drawn inside them. With a keyed mask (``minitrain.dropout``:
a function of (row, global head, query position, key position)) any rank can draw any block's
mask, but the tiles have nowhere to apply it. So when the attention probabilities are dropped
and the GPT holds a dropout key, the context-parallel attention all-gathers K and V over the
group instead — as Llama 3's context parallelism does (Dubey et al. 2024, section 3.3.2) — and
attends this rank's queries to the whole sequence: the causal mask from global positions, the
dropout keyed by global positions, so the masks (and the loss) are one process's.

Cost, per rank (b batch, h heads, n = N/P tokens, d head size): the forward sends the same
(P−1)·2·b·h·n·d elements as the ring (without hiding them behind compute); backward
all-reduces the gathered dK, dV (2·b·h·N·d elements: twice the reduce-scatter Llama 3's
design needs, ``cp_bytes_per_rank``, kept because the all-reduce is one collective every
backend has); memory holds K, V of the whole sequence and the (b, h, n, N) probabilities and
mask — 1/P of one process's, not FlashAttention's O(n). ``cp_bytes_per_rank`` puts the two
designs side by side (notebook 10, section 10).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from minitrain.context_parallel.layout import shard_positions
from minitrain.context_parallel.ring import SOURCE
from minitrain.dropout import DropoutSite
from minitrain.model import dropout
from minitrain.runtime.communication_log import COMMUNICATION_LOG


class GatherSequence(torch.autograd.Function):
    """``apply(x, group)``: every rank's ``x`` concatenated along dim -2 in rank order; backward
    sums the gathered gradient over the group (each rank's queries reached every block) and
    keeps this rank's block."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        world = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        nbytes = x.numel() * x.element_size()
        COMMUNICATION_LOG.record(SOURCE, "all-gather K,V", (world - 1) * nbytes,
                                 world * nbytes, world)
        return torch.cat(parts, dim=-2)

    @staticmethod
    def backward(ctx, grad):
        world, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        total = grad.clone(memory_format=torch.contiguous_format)  # the incoming grad is autograd's
        dist.all_reduce(total, group=ctx.group)
        nbytes = total.numel() * total.element_size()
        COMMUNICATION_LOG.record(SOURCE, "all-reduce dK,dV", 2 * (world - 1) * nbytes // world,
                                 nbytes, world)
        return total.chunk(world, dim=-2)[rank].contiguous(), None


def gathered_attention(q, k, v, causal: bool, dropout_p: float, site: DropoutSite,
                       group: ProcessGroup | None = None, layout: str = "contiguous"):
    """This rank's shard of attention over the whole sequence, with keyed dropout ``dropout_p``
    on the probabilities. ``q``, ``k``, ``v``: ``(batch, heads, n, d)``, this rank's shard as
    ``shard_sequence(x, group, layout)`` cuts it; ``site``: the attention's dropout site."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = q.shape[-2]
    kv = GatherSequence.apply(torch.stack([k, v]), group)  # (2, b, h, N, d): one collective
    # where every rank's tokens sit: the gathered keys' global positions, in rank order
    where = [shard_positions(n * world, r, world, layout, device=q.device) for r in range(world)]
    q_pos, k_pos = where[rank], torch.cat(where)
    scores = (q * (1.0 / math.sqrt(q.shape[-1]))) @ kv[0].transpose(-2, -1)
    if causal:  # by global position: the gathered keys are not in sequence order (zigzag)
        future = k_pos[None, :] > q_pos[:, None]
        bias = torch.zeros(future.shape, dtype=scores.dtype, device=q.device)
        scores = scores + bias.masked_fill(future, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = dropout(probs, dropout_p, True, site.at_positions(q_pos, k_pos))
    return probs @ kv[1]


def cp_bytes_per_rank(batch_heads: int, seq_len: int, head_dim: int, world_size: int,
                      bytes_per_element: int = 4, method: str = "ring") -> dict:
    """Bytes one rank sends in one attention's forward and backward, and the K, V bytes it
    holds at once while attending, for ``method`` "ring" (Liu et al. 2023: chapter 10) or
    "all-gather" (Llama 3, Dubey et al. 2024 section 3.3.2: K and V all-gathered before
    attention and kept for backward, dK and dV reduce-scattered after). ``batch_heads``
    counts K/V heads (with GQA fewer than the query heads: the reason Llama 3 can afford it).

    With ``block`` = one rank's K (or V) shard, bh·(N/P)·d·e bytes: the ring sends K and V
    P−1 hops forward and again backward with dK, dV P hops (the last one home); a ring
    all-gather sends each rank's K, V P−1 hops, a reduce-scatter dK, dV P−1 hops. The ring
    holds two K, V blocks (in hand and arriving); the all-gather the whole sequence's."""
    P = world_size
    block = batch_heads * (seq_len // P) * head_dim * bytes_per_element
    if method not in ("ring", "all-gather"):
        raise ValueError(f"method {method!r}: expected 'ring' or 'all-gather'")
    if P == 1:
        return {"forward": 0, "backward": 0, "kv_held": 2 * block}
    if method == "ring":
        return {"forward": (P - 1) * 2 * block, "backward": (P - 1) * 2 * block + P * 2 * block,
                "kv_held": 2 * 2 * block}
    return {"forward": (P - 1) * 2 * block, "backward": (P - 1) * 2 * block,
            "kv_held": P * 2 * block}
