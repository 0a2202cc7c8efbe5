"""Counting chapter 6: bytes communicated and activation bytes per rank, against formulas.

Used by notebooks/06_tensor_parallel.ipynb, its widget (minitrain.widgets.ch06_tensor_parallel)
and ``python -m minitrain.bench tp``. Notation: b batch, s sequence, h d_model, f d_ff,
a heads, t tensor-parallel size, e bytes per element (4 in fp32).

Communication per block (Shoeybi et al. 2019, section 3; Korthikanti et al. 2022, section
4.2.2): tensor parallelism all-reduces b*s*h elements twice forward (after attention and
after the MLP) and twice backward (f in front of each); sequence parallelism replaces each
all-reduce by an all-gather and a reduce-scatter of the same b*s*h tensor. On a ring an
all-reduce sends 2(t-1)/t of the message per rank, an all-gather or reduce-scatter
(t-1)/t: the same bytes either way. Counted *logically* (mappings.communication_log):
what the algorithm asks for, whatever gloo does underneath.

Activation memory per block, per rank: ``block_activation_bytes_tp`` below.
"""

from __future__ import annotations

import torch

from minitrain.launch import launch
from minitrain.memory import saved_activation_bytes
from minitrain.tensor_parallel import mappings


def block_communication_bytes(batch, seq_len, d_model, tp_size, sequence_parallel=False,
                              bias=True, bytes_per_element=4) -> dict:
    """Per direction ("forward", "backward"): the collectives of one block (sorted names),
    the bytes of their messages and the bytes one rank sends on a ring (all 0 for t = 1).

    With sequence parallelism backward also sums the gradients of the parameters that
    saw only a shard of the sequence: ln_1's and ln_2's gain (and, with biases, their
    biases and the two row-parallel biases), one all-reduce of h elements each.
    """
    t, e = tp_size, bytes_per_element
    message = batch * seq_len * d_model * e
    if t == 1:
        ops, params = [], 0
    elif sequence_parallel:  # per sub-block: all-gather in, reduce-scatter out
        ops = [("all-gather", 1, message), ("reduce-scatter", 1, message)] * 2
        params = 6 if bias else 2
    else:  # per sub-block: one all-reduce (g forward, f backward)
        ops, params = [("all-reduce", 2, message)] * 2, 0

    def total(entries):
        return {"collectives": sorted(n for n, _, _ in entries),
                "message_bytes": sum(m for _, _, m in entries),
                "ring_bytes": sum(round(k * (t - 1) / t * m) for _, k, m in entries)}

    return {"forward": total(ops),
            "backward": total(ops + [("all-reduce", 2, d_model * e)] * params)}


def block_activation_bytes_tp(batch, seq_len, d_model, n_head, d_ff=None, tp_size=1,
                              sequence_parallel=False, dropout=0.0, bytes_per_element=4) -> int:
    """Bytes one rank's block saves for backward under tensor parallelism of size t.

    Korthikanti et al. 2022 (section 4.2) per layer, in their fp16 units with dropout:
    sbh(10 + 24/t + 5as/(ht)) with tensor parallelism. Term by term for this model
    (minitrain.memory.block_activation_bytes is the t = 1 case):
      split by t (each rank's heads / MLP slice): q, k, v, out_proj input 4sbh e,
        GELU and fc_out inputs 2sbf e, softmax as^2b e (with dropout + as^2b(1 + e));
      replicated: ln_1 and ln_2 inputs 2sbh e, q/k/v and fc_in inputs 2sbh e,
        LayerNorm statistics 16sb, residual-dropout masks 2sbh.
    With sequence parallelism (their sbh(34/t + 5as/(ht))) LayerNorm inputs, statistics
    and dropout masks are split by t too. The q/k/v and fc_in inputs are not here: we keep
    the all-gathered tensor autograd saves (2sbh e per rank), where Megatron saves the
    shard and all-gathers again in backward. With e = 2 and dropout the non-SP count is
    exactly the paper's.
    """
    b, s, h, a, t, e = batch, seq_len, d_model, n_head, tp_size, bytes_per_element
    f = 4 * h if d_ff is None else d_ff
    split = (4 * s * b * h + 2 * s * b * f + a * s * s * b) * e
    norm_inputs, gathered_inputs, stats = 2 * s * b * h * e, 2 * s * b * h * e, 16 * s * b
    masks = 0
    if dropout > 0:
        split += a * s * s * b * (1 + e)
        masks = 2 * s * b * h
    sharded_by_sp = norm_inputs + stats + masks
    if sequence_parallel:
        return (split + sharded_by_sp) // t + gathered_inputs
    return split // t + sharded_by_sp + gathered_inputs


def _rank_measure(config_kwargs, batch, sequence_parallel):
    """On each rank: one block's collectives forward and backward, its saved bytes."""
    import torch.distributed as dist

    from minitrain import trace
    from minitrain.model import GPT, GPTConfig
    from minitrain.tensor_parallel import apply_tensor_parallel

    torch.manual_seed(0)
    config = GPTConfig(**config_kwargs)
    model = apply_tensor_parallel(GPT(config), sequence_parallel=sequence_parallel)
    t, s = dist.get_world_size(), config.seq_len
    x = torch.randn(batch, s // t if sequence_parallel else s, config.d_model,
                    generator=torch.Generator().manual_seed(1))
    block = model.blocks[0]
    out = {"activation_bytes": saved_activation_bytes(block, x)}
    x.requires_grad_()
    mappings.reset_communication_log()
    trace.reset()
    with trace.span("block forward", "compute"):
        y = block(x)
    out["forward"] = mappings.communication_log()
    mappings.reset_communication_log()
    with trace.span("block backward", "compute"):
        y.backward(torch.ones_like(y))
    out["backward"] = mappings.communication_log()
    out["shards"] = {n: tuple(p.shape) for n, p in block.named_parameters()}
    return out


def measure_block(config_kwargs: dict, batch: int, tp_size: int, sequence_parallel=False,
                  timeout: float = 120.0) -> dict:
    """Run one block of the TP GPT on ``tp_size`` ranks. Returns rank 0's
    {"forward", "backward"} (lists of (collective, message bytes, ring bytes)),
    "activation_bytes" of every rank, "shards" (parameter shapes on a rank) and the
    per-rank trace events ("traces")."""
    results = launch(_rank_measure, tp_size, config_kwargs, batch, sequence_parallel,
                     timeout=timeout)
    first = dict(results[0])
    first["activation_bytes"] = [r["activation_bytes"] for r in results]
    first["traces"] = results.traces
    return first


def summarize_log(log) -> dict:
    """{"collectives" (sorted names), "message_bytes", "ring_bytes"} of a communication log:
    comparable with ``block_communication_bytes``."""
    return {"collectives": sorted(n for n, _, _ in log), "message_bytes": sum(m for _, m, _ in log),
            "ring_bytes": sum(r for _, _, r in log)}
