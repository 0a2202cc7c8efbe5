"""Chapter 10 solutions — generated from minitrain.context_parallel.merge, minitrain.context_parallel.ring.

The worked answers. Look one up when you are stuck; the library has them too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from minitrain.context_parallel.layout import check_divisible, rank_chunks
from minitrain.context_parallel.ring import Exchange, causal_blocks
from minitrain.flash_attention import flash_attention_backward, flash_attention_forward
from minitrain.runtime import trace
from minitrain.runtime.communication_log import COMMUNICATION_LOG
from minitrain.runtime.point_to_point import ring_neighbours


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Combine two partial attention results of the same queries over disjoint key sets.

    ``out_*`` have shape ``(..., n, d)``, ``lse_*`` shape ``(..., n)`` (the logsumexp of
    each query's scores over that key set; ``-inf`` where the set was empty for the
    query). Returns ``(out, lse)``: attention over the union, and its logsumexp.

    Scores can be large (lse of 1000 is ordinary with unscaled logits): ``e^{lse}``
    overflows float32 above 88, so work with ``e^{lse_x − m}``, m = max(lse_a, lse_b),
    never with ``e^{lse_x}`` itself. Where both are ``-inf`` the result is out = 0,
    lse = -inf (a query that has seen no key yet). ``out`` keeps ``out_a``'s dtype, ``lse``
    its own.

    Requirements and why: merging A with B or B with A gives the same result (ring attention
    merges blocks in whatever order they arrive); ``lse`` is the union's, so the next merge
    can weigh this result against the next block.
    """
    ### BEGIN SOLUTION
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # both -inf: keep exp finite
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    lse = m + torch.log(total)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out = (out_a * w_a.unsqueeze(-1) + out_b * w_b.unsqueeze(-1)) / safe.unsqueeze(-1)
    return out.to(out_a.dtype), lse
    ### END SOLUTION


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

# minitrain-exercises-hash: 94962a45815fc459
