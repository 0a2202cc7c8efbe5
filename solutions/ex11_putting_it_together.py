"""Chapter 11 solutions — generated from minitrain.parallel.mesh, minitrain.parallel.planner.

The worked answers. Look one up when you are stuck; the library has them too.
"""

from __future__ import annotations

import torch.distributed as dist
from dataclasses import dataclass
from typing import NamedTuple
from minitrain.collectives.cost_model import predict_all_reduce
from minitrain.model import GPTConfig
from minitrain.moe.measure import all_to_all_bytes_formula
from minitrain.parallel.layouts import Layout, enumerate_layouts, layout_dict
from minitrain.parallel.mesh import AXES, MeshCoords, _sizes
from minitrain.pipeline import split_blocks
from minitrain.step import flops_per_token
from minitrain.tensor_parallel.measure import layer_activation_bytes
from minitrain.zero import memory_formula


def rank_coords(rank: int, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1) -> MeshCoords:
    """The (pp, dp, cp, tp) coordinates of global ``rank`` in a PP × DP × CP × TP mesh.

    The rank is a number written in mixed radix with digits (pp, dp, cp, tp), tp the least
    significant: rank = ((pp_i·DP + dp_i)·CP + cp_i)·TP + tp_i. So ranks 0..TP-1 form the
    first tensor-parallel group (adjacent ranks), and pipeline stage s holds ranks
    s·DP·CP·TP .. (s+1)·DP·CP·TP - 1.
    """
    sizes = _sizes(dp, tp, pp, cp)
    world = dp * tp * pp * cp
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a mesh of {world} ranks ({sizes})")
    ### BEGIN SOLUTION
    digits = {}
    for axis in reversed(AXES):  # tp, cp, dp, pp
        rank, digits[axis] = divmod(rank, sizes[axis])
    return MeshCoords(**digits)
    ### END SOLUTION


def axis_groups(axis: str, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1) -> list[list[int]]:
    """Every group along ``axis``: lists of global ranks that differ only in that coordinate.

    E.g. DP2 × TP2 × PP2 (8 ranks): ``axis_groups("tp", ...)`` = [[0, 1], [2, 3], [4, 5],
    [6, 7]], ``axis_groups("pp", ...)`` = [[0, 4], [1, 5], [2, 6], [3, 7]]. Groups are
    listed in order of their lowest rank, and each group's ranks in coordinate order
    (rank i of the group has coordinate i along ``axis``).
    """
    sizes = _sizes(dp, tp, pp, cp)
    if axis not in sizes:
        raise ValueError(f"unknown mesh axis {axis!r}; expected one of {list(AXES)}")
    ### BEGIN SOLUTION
    world = dp * tp * pp * cp
    stride = 1
    for inner in reversed(AXES[AXES.index(axis) + 1 :]):
        stride *= sizes[inner]
    groups = []
    for start in range(world):
        if (start // stride) % sizes[axis] == 0:  # coordinate 0 along axis: a group's first rank
            groups.append([start + i * stride for i in range(sizes[axis])])
    return groups
    ### END SOLUTION


def params_per_rank(config: GPTConfig, tp: int = 1, pp: int = 1, stage: int = 0) -> int:
    """Exact number of parameters pipeline stage ``stage`` of ``pp`` holds on one of ``tp``
    tensor-parallel ranks, for the course's GPT split as chapters 6 and 7 split it.

    Column-parallel Linears (q, k, v, fc_in, the head) keep 1/t of their weight and of their
    bias, if they have one (the head has none); row-parallel ones (out_proj, fc_out) 1/t of
    their weight and a *whole* bias (added once, after the sum); LayerNorms and the position
    table are replicated; the token embedding keeps 1/t of its rows. Stage 0 holds the
    embeddings, the last stage ln_f and the head, and the blocks are cut as
    ``minitrain.pipeline.split_blocks`` cuts them (extras to the first stages).
    ``config.bias`` False removes the biases only (a LayerNorm keeps its gain);
    ``config.tie_weights`` makes the head the token embedding itself: one matrix, counted
    once (pipelines refuse tied weights, so it only happens with pp = 1).
    Returns an int, exactly what ``sum(p.numel() for p in stage.parameters())`` gives on
    such a rank.
    """
    ### BEGIN SOLUTION
    h, f, v, t = config.d_model, config.d_ff, config.vocab_size, tp
    b = 1 if config.bias else 0
    attention = 4 * h * h // t + b * (3 * h // t + h)
    mlp = 2 * h * f // t + b * (f // t + h)
    norms = 2 * (h + b * h)
    total = len(split_blocks(config.n_layer, pp)[stage]) * (attention + mlp + norms)
    if stage == 0:
        total += v * h // t + config.seq_len * h
    if stage == pp - 1:
        total += (h + b * h) + (0 if config.tie_weights else v * h // t)
    return total
    ### END SOLUTION

# minitrain-exercises-hash: 76e34234067660ea
