"""Ring attention: exact attention over a sequence split across the ranks of a group.

Used by notebooks/10_context_parallel.ipynb. Liu, Zaharia & Abbeel 2023, "Ring Attention
with Blockwise Transformers for Near-Infinite Context" (section 3, Algorithm 1): each of P
ranks holds a shard of q, k, v along the sequence. In P steps every rank computes
attention of its queries against the key/value block in hand while *sending that block on*
to the next rank and receiving the next one from the previous (the send and the receive
paired in one ``batch_isend_irecv`` group, started before the compute, waited after it, so
the transfer hides behind the compute).
Partial results are merged by their logsumexp (``merge.merge_attention``).

Each block is computed by chapter 9's tiled kernels (``minitrain.flash_attention``):
``flash_attention_forward`` returns a block's output and logsumexp, and
``flash_attention_backward``, given the *global* output and logsumexp, one block's exact
gradients (Dao 2023, Algorithm 2) — so ring attention is FlashAttention's outer loop with
the key/value blocks arriving from other ranks.

Backward (an autograd Function): the key/value blocks travel round the ring again, each
carrying its dK, dV accumulator: rank r adds its queries' share to the block in hand and
passes block and accumulator on; after P steps the accumulator has visited every rank and
one last hop brings it home. dQ stays local.

Bytes one rank sends per call (b batch, h heads, n = N/P tokens per rank, d head size,
e bytes per element; a K or V block is b·h·n·d·e bytes):
    forward  (P−1) · 2 blocks   (K and V, each block visiting the P−1 other ranks)
    backward (P−1) · 2 blocks   (K and V again)  +  P · 2 blocks   (dK and dV, home included)
``communication_log`` records them as sent; ``measure.ring_bytes`` is the formula.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from minitrain.context_parallel.layout import check_divisible, rank_chunks
from minitrain.context_parallel.merge import merge_attention
from minitrain.flash_attention import flash_attention_backward, flash_attention_forward
from minitrain.runtime import trace
from minitrain.runtime.communication_log import COMMUNICATION_LOG
from minitrain.runtime.point_to_point import ring_neighbours

KV_TAG, GRAD_TAG = 10, 11  # two exchanges can be in flight to the same neighbour at once
SOURCE = "cp"  # ring attention's records in the runtime's communication log


def communication_log() -> list[tuple[str, int]]:
    """(what, bytes) for every tensor this process sent since the last reset."""
    return [(r.kind, r.sent_bytes) for r in COMMUNICATION_LOG.records(SOURCE)]


def reset_communication_log() -> None:
    COMMUNICATION_LOG.reset(SOURCE)


class Exchange:
    """Send ``tensor`` to the next rank and receive the previous rank's, started now
    (the two paired in one ``batch_isend_irecv`` group).

    ``wait()`` blocks until both are done and returns the received tensor; the time from
    start to wait is recorded in ``minitrain.runtime.trace`` as communication. With one rank the
    ring is a loop: the tensor is its own successor and nothing is sent.
    """

    def __init__(self, tensor, group: ProcessGroup | None = None, what="K,V", tag=KV_TAG):
        self.what, self.start, self.requests = what, trace.now(), []
        self.sent = tensor.contiguous()  # kept alive until the send completes
        if dist.get_world_size(group) == 1:
            self.received = self.sent
            return
        prev_rank, next_rank = ring_neighbours(group)
        self.received = torch.empty_like(self.sent)
        # one group (NCCL's group call; Megatron pairs so): NCCL runs a rank's operations in
        # order, so a lone send waits for its successor's receive, queued behind that rank's own
        # send — a cycle round the ring (issue 41); in one group they progress together
        self.requests = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, self.sent, next_rank, group=group, tag=tag),
            dist.P2POp(dist.irecv, self.received, prev_rank, group=group, tag=tag)])
        nbytes = self.sent.numel() * self.sent.element_size()
        COMMUNICATION_LOG.record(SOURCE, what, nbytes, nbytes, dist.get_world_size(group))

    def wait(self) -> torch.Tensor:
        """Block until sent and received; the in-flight time is traced as communication,
        the time spent blocked here (communication the compute did not hide) as idle."""
        called = trace.now()
        for request in self.requests:
            request.wait()
        if self.requests:
            done = trace.now()
            trace.record(f"send/recv {self.what}", "communication", self.start, done)
            trace.record(f"waiting for {self.what}", "idle", called, done)
        return self.received


def causal_blocks(q_chunks, kv_chunks, causal):
    """(i, j, diagonal) for each (query chunk i, key chunk j) pair that must be computed.

    Chunks are equal, so a key chunk is wholly in a query chunk's past (compute it all),
    wholly in its future (skip it: causal attention gives it zero weight) or the same
    chunk (compute with the ordinary causal mask).
    """
    for i, qc in enumerate(q_chunks):
        for j, kc in enumerate(kv_chunks):
            if causal and kc > qc:
                continue
            yield i, j, causal and kc == qc


def ring_step(qs, q_chunks, kv, kv_chunks, outs, lses, causal, group: ProcessGroup | None = None,
              send=True):
    """One forward step of ring attention; returns the next K/V block (None if not ``send``).

    ``qs``: this rank's query chunks (a list, chunk indices ``q_chunks``); ``kv``: the
    block in hand, K and V stacked (``kv[0]``, ``kv[1]``), holding chunks ``kv_chunks``
    in order; ``outs``/``lses``: per query chunk, the running output and logsumexp so far
    (``None`` before its first block), updated in place. Start sending ``kv`` on
    (``Exchange``) *before* computing, so the transfer overlaps the compute; compute each
    needed (query chunk, key chunk) pair with ``flash_attention_forward`` (``causal_blocks``
    says which, and where the causal mask applies); merge into ``outs``/``lses`` with
    ``merge_attention``; then wait for the block from the previous rank and return it.

    May use: ``Exchange(tensor, group, what)`` (starts the send and receive; ``.wait()``
    returns the received tensor), ``causal_blocks(q_chunks, kv_chunks, causal)`` (yields
    ``(i, j, diagonal)``), ``flash_attention_forward(q, k, v, causal=...)`` (returns
    ``(out, lse)``), ``merge_attention``. Why the order matters: ring attention is only as
    fast as one rank's compute if each transfer hides behind it (Liu et al. 2023, section 3);
    the last step (``send=False``) sends nothing and returns None.
    """
    ### BEGIN SOLUTION
    exchange = Exchange(kv, group, "forward K,V") if send else None
    ks, vs = kv[0].chunk(len(kv_chunks), dim=-2), kv[1].chunk(len(kv_chunks), dim=-2)
    with trace.span("attention block", "compute"):
        for i, j, diagonal in causal_blocks(q_chunks, kv_chunks, causal):
            out, lse = flash_attention_forward(qs[i], ks[j], vs[j], causal=diagonal)
            if outs[i] is None:
                outs[i], lses[i] = out, lse
            else:
                outs[i], lses[i] = merge_attention(outs[i], lses[i], out, lse)
    return exchange.wait() if exchange is not None else None
    ### END SOLUTION


def ring_forward(q, k, v, causal=False, group: ProcessGroup | None = None, layout="contiguous"):
    """(out, lse) of this rank's queries over the whole sequence: P calls of ``ring_step``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    q_chunks = rank_chunks(rank, world, layout)
    qs = list(q.chunk(len(q_chunks), dim=-2))
    outs, lses = [None] * len(qs), [None] * len(qs)
    kv = torch.stack([k, v])
    for step in range(world):
        # at step s this rank holds the block that started on rank r - s
        kv_chunks = rank_chunks((rank - step) % world, world, layout)
        kv = ring_step(qs, q_chunks, kv, kv_chunks, outs, lses, causal, group,
                       send=step < world - 1)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def ring_backward(q, k, v, out, lse, grad_out, causal=False, group: ProcessGroup | None = None,
                  layout="contiguous"):
    """(dq, dk, dv) of this rank's shard; dK and dV travel round the ring with their block."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    q_chunks = rank_chunks(rank, world, layout)
    n = len(q_chunks)
    qs, outs, lses = q.chunk(n, dim=-2), out.chunk(n, dim=-2), lse.chunk(n, dim=-1)
    dos = grad_out.chunk(n, dim=-2)
    dqs = [torch.zeros_like(c) for c in qs]
    kv, pending = torch.stack([k, v]), None
    for step in range(world):
        kv_chunks = rank_chunks((rank - step) % world, world, layout)
        next_kv = Exchange(kv, group, "backward K,V") if step < world - 1 else None
        dkv = torch.zeros_like(kv)  # this rank's share of the block's dK, dV
        ks, vs = kv[0].chunk(n, dim=-2), kv[1].chunk(n, dim=-2)
        dks, dvs = dkv[0].chunk(n, dim=-2), dkv[1].chunk(n, dim=-2)  # views into dkv
        with trace.span("attention block backward", "compute"):
            for i, j, masked in causal_blocks(q_chunks, kv_chunks, causal):
                dq, dk, dv = flash_attention_backward(qs[i], ks[j], vs[j], outs[i], lses[i],
                                                      dos[i], causal=masked)
                dqs[i] += dq
                dks[j].add_(dk)
                dvs[j].add_(dv)
        if pending is not None:  # what the earlier ranks accumulated for this block
            dkv += pending.wait()
        pending = Exchange(dkv, group, "backward dK,dV", tag=GRAD_TAG)
        if next_kv is not None:
            kv = next_kv.wait()
    home = pending.wait()  # the last hop: this rank's own block, every rank's share added
    return torch.cat(dqs, dim=-2), home[0], home[1]


class RingAttentionFunction(torch.autograd.Function):
    """``apply(q, k, v, causal, group, layout)``: ring attention with a ring backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal, group, layout):
        out, lse = ring_forward(q, k, v, causal, group, layout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.group, ctx.layout = causal, group, layout
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(q, k, v, out, lse, grad_out, ctx.causal, ctx.group, ctx.layout)
        return dq, dk, dv, None, None, None


def ring_attention(q, k, v, causal=False, group: ProcessGroup | None = None, layout="contiguous"):
    """This rank's shard of attention over the whole sequence, split across ``group``.

    ``q``, ``k``, ``v``: ``(..., n, d)``, this rank's shard of the sequence as
    ``shard_sequence(x, group, layout)`` cuts it (n = N/P tokens). Returns this rank's shard
    of softmax(q kᵀ/√d) v over all N keys (causal: query i sees keys j ≤ i, by global
    position), differentiable with respect to q, k and v.
    """
    world = dist.get_world_size(group)
    if not q.shape[-2] == k.shape[-2] == v.shape[-2]:
        raise ValueError(f"q, k, v must hold the same tokens, got shapes {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    check_divisible(q.shape[-2] * world, world, layout)
    return RingAttentionFunction.apply(q, k, v, causal, group, layout)
