"""Which part of the sequence each rank of a context-parallel group holds.

Used by notebooks/10_context_parallel.ipynb. Context parallelism cuts the *sequence*
(dimension -2 of q, k, v, the activations' token dimension) across P ranks. Two layouts:

- ``"contiguous"``: P equal slices, rank r holds slice r. With causal attention rank 0's
  queries see only its own keys while rank P-1's see everyone's: the last rank does about
  2P-1 times the work of the first.
- ``"zigzag"``: 2P equal slices, rank r holds slices r and 2P-1-r (an early and a late
  one), so every rank does the same causal work (Brandon et al. 2023, "Striped
  Attention", make the same point with a striped layout; the zigzag form is Megatron-LM's
  and ring-flash-attention's).

Everything is stated in *chunks*: the sequence cut into P (contiguous) or 2P (zigzag)
equal chunks, a rank holding a list of chunk indices in order. Ring attention only
needs to compare chunk indices to know whether a block of keys is in a query's past.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

LAYOUTS = ("contiguous", "zigzag")


def num_chunks(world_size: int, layout: str) -> int:
    """How many equal chunks the sequence is cut into: P (contiguous) or 2P (zigzag)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return world_size if layout == "contiguous" else 2 * world_size


def rank_chunks(rank: int, world_size: int, layout: str) -> list[int]:
    """The chunk indices rank ``rank`` holds, in the order they sit in its shard."""
    if layout == "contiguous":
        num_chunks(world_size, layout)  # validates the name
        return [rank]
    num_chunks(world_size, layout)
    return [rank, 2 * world_size - 1 - rank]


def check_divisible(seq_len: int, world_size: int, layout: str) -> int:
    """The chunk length; a clear error when the sequence cannot be cut evenly.

    The rule: contiguous needs N divisible by P, zigzag by 2P (every chunk the same
    length, so a block of keys is either wholly in a query chunk's past, wholly in its
    future, or the same chunk — the diagonal, where the ordinary causal mask applies).
    """
    chunks = num_chunks(world_size, layout)
    if seq_len % chunks:
        what = f"P = {world_size}" if layout == "contiguous" else f"2P = {chunks} (P = {world_size})"
        raise ValueError(
            f"sequence length {seq_len} is not divisible by {what}: the {layout} layout cuts "
            f"the sequence into {chunks} equal chunks"
        )
    return seq_len // chunks


def shard_positions(seq_len: int, rank: int, world_size: int, layout: str = "contiguous",
                    device="cpu"):
    """The token positions (a LongTensor on ``device``) rank ``rank`` holds, in its shard's
    order."""
    c = check_divisible(seq_len, world_size, layout)
    chunks = rank_chunks(rank, world_size, layout)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunks])


def shard_sequence(x: torch.Tensor, group: ProcessGroup | None = None,
                   layout: str = "contiguous") -> torch.Tensor:
    """This rank's shard of ``x`` along dimension -2 (the sequence), as a new tensor.

    ``x`` is the whole sequence, the same on every rank. Contiguous: rank r gets the r-th
    of P slices; zigzag: slices r and 2P-1-r of 2P, concatenated in that order.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    check_divisible(x.shape[-2], world, layout)
    chunks = x.chunk(num_chunks(world, layout), dim=-2)
    return torch.cat([chunks[i] for i in rank_chunks(rank, world, layout)], dim=-2)


def gather_sequence(shard: torch.Tensor, group: ProcessGroup | None = None,
                    layout: str = "contiguous") -> torch.Tensor:
    """Undo ``shard_sequence``: every rank gets the whole sequence (an all-gather).

    Differentiable is not needed here (tests and the notebook gather results to compare);
    the gathered chunks are put back in sequence order.
    """
    world = dist.get_world_size(group)
    parts = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(parts, shard.contiguous(), group=group)
    per_rank = len(rank_chunks(0, world, layout))
    ordered: list = [None] * num_chunks(world, layout)
    for r, part in enumerate(parts):
        for i, piece in zip(rank_chunks(r, world, layout), part.chunk(per_rank, dim=-2)):
            ordered[i] = piece
    return torch.cat(ordered, dim=-2)
