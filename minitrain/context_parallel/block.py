"""A plain attention block returning its logsumexp (stand-in until chapter 9's kernels land).

Forward: out = softmax(q kᵀ/√d) v and lse = logsumexp(q kᵀ/√d) per query. Backward from the
*global* out and lse (Dao et al. 2022, Algorithm 2 / Appendix B.2): with P = exp(S − lse)
the global probabilities restricted to this block, D = rowsum(dO ∘ O),
dV = Pᵀ dO, dS = P ∘ (dO Vᵀ − D), dQ = dS K/√d, dK = dSᵀ Q/√d.
"""

from __future__ import annotations

import math

import torch


def _scores(q, k, causal):
    s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def block_attention_forward(q, k, v, causal=False):
    """(out, lse) of attention of ``q`` over ``k``, ``v`` (causal: query i sees keys j ≤ i)."""
    s = _scores(q.float(), k.float(), causal)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.exp(s - lse.unsqueeze(-1)) @ v.float()
    return out.to(q.dtype), lse


def block_attention_backward(q, k, v, out, lse, grad_out, causal=False):
    """(dq, dk, dv) of this block, given the *global* ``out`` and ``lse`` of these queries."""
    q_, k_, v_, do = q.float(), k.float(), v.float(), grad_out.float()
    p = torch.exp(_scores(q_, k_, causal) - lse.unsqueeze(-1))
    dv = p.transpose(-2, -1) @ do
    dp = do @ v_.transpose(-2, -1)
    ds = p * (dp - (do * out.float()).sum(-1, keepdim=True))
    scale = 1.0 / math.sqrt(q.shape[-1])
    dq, dk = (ds @ k_) * scale, (ds.transpose(-2, -1) @ q_) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
