"""All-to-all with uneven splits, differentiable, with the splits checked (chapter 8,
notebook 08).

Expert parallelism (GShard, Lepikhin et al. 2020, section 2.2) moves each token to the rank
holding its expert and back with two all-to-alls. The number of rows a rank sends to each
peer changes every step, so ``all_to_all_single`` runs with uneven ``input_split_sizes`` /
``output_split_sizes``: a rank first learns how much it will *receive* from an all-to-all
of the counts. Those two lists must agree between every pair of ranks — what r sends to p
is what p expects from r. gloo does not check: given splits that disagree it silently
returns garbage (NCCL hangs instead), measured here with torch 2.13. So
``check_splits`` gathers every rank's splits and fails, on every rank alike, with a message
naming the ranks and the counts.

Every exchange is logged *logically* (the rows one rank sends to the others, its own block
excluded), so the bytes can be checked against tokens · k · d · bytes · (P−1)/P.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from minitrain.runtime import trace
from minitrain.runtime.communication_log import COMMUNICATION_LOG
from minitrain.runtime.rank import get_device

SOURCE = "moe"  # expert parallelism's records in the runtime's communication log


def communication_log() -> list[tuple[str, int]]:
    """(name, bytes this rank sent to *other* ranks) of each all-to-all since the last reset."""
    return [(r.kind, r.sent_bytes) for r in COMMUNICATION_LOG.records(SOURCE)]


def reset_communication_log() -> None:
    COMMUNICATION_LOG.reset(SOURCE)


def exchange_counts(send_counts: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """All-to-all of equal chunks: chunk p of ``send_counts`` goes to rank p; returns the
    chunks received, chunk r from rank r (same shape)."""
    received = torch.empty_like(send_counts)
    with trace.span("all-to-all counts", "communication"):
        dist.all_to_all_single(received, send_counts.contiguous(), group=group)
    return received


def check_splits(send_splits: list[int], recv_splits: list[int],
                 group: ProcessGroup | None = None, device=None) -> None:
    """Fail on every rank if rank r's send to p differs from what p expects from r.

    One all-gather of 2P integers per rank: then every rank sees the whole matrix and
    raises the same error, so none is left waiting in the all-to-all.
    """
    world = dist.get_world_size(group)
    # on ``device`` (the tokens'; this rank's device if not given): NCCL takes no CPU tensor
    device = get_device() if device is None else device
    mine = torch.tensor(list(send_splits) + list(recv_splits), dtype=torch.long, device=device)
    table = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(table, mine, group=group)
    bad = [(r, p, int(table[r][p]), int(table[p][world + r]))
           for r in range(world) for p in range(world)
           if int(table[r][p]) != int(table[p][world + r])]
    if bad:
        details = "; ".join(f"rank {r} sends {s} rows to rank {p}, which expects {e}"
                            for r, p, s, e in bad)
        raise RuntimeError(f"all-to-all splits disagree between ranks: {details}")


def _all_to_all(x: torch.Tensor, out_splits, in_splits, group, name: str) -> torch.Tensor:
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    with trace.span(name, "communication"):
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=list(out_splits),
                               input_split_sizes=list(in_splits), group=group)
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    # logical bytes: the rows sent to *other* ranks (a rank's own block never leaves it)
    COMMUNICATION_LOG.record(
        SOURCE, name, row_bytes * (sum(in_splits) - in_splits[dist.get_rank(group)]),
        row_bytes * sum(in_splits), dist.get_world_size(group))
    return out


class AllToAll(torch.autograd.Function):
    """Rows ``in_splits[p]`` of x go to rank p; ``out_splits[r]`` rows arrive from rank r.

    Backward is the same exchange reversed: the gradient of the rows a rank received goes
    back to the rank they came from (splits swapped).
    """

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, name):
        ctx.splits, ctx.group, ctx.name = (list(out_splits), list(in_splits)), group, name
        return _all_to_all(x, out_splits, in_splits, group, name)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return (_all_to_all(grad, in_splits, out_splits, ctx.group, ctx.name + " (backward)"),
                None, None, None, None)


def all_to_all(x, out_splits, in_splits, group: ProcessGroup | None = None, name="all-to-all"):
    return AllToAll.apply(x, list(out_splits), list(in_splits), group, name)
