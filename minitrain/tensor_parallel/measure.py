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

from minitrain.memory import saved_activation_bytes
from minitrain.runtime import get_device, launch
from minitrain.tensor_parallel import mappings

LAYERS = ("embedding", "attention", "mlp", "head")


def layer_collectives(layer, batch, seq_len, d_model, tp_size, sequence_parallel=False,
                      bias=True, table_rows=None, bytes_per_element=4):
    """(forward, backward) collectives of one layer, each (name, ring factor, message bytes).

    attention / mlp: ln + the column -> row pair; embedding: tok_emb + pos_emb; head: ln_f,
    the LM head and the vocab-parallel loss (three all-reduces of one fp32 per token).
    With sequence parallelism backward also sums the gradients of the replicated
    parameters that saw a shard of the sequence (LayerNorms, row biases, the position
    table of ``table_rows`` rows), one all-reduce each.
    """
    b, s, h, t, e = batch, seq_len, d_model, tp_size, bytes_per_element
    act = b * s * h * e  # the b*s*h activation every collective of a block moves

    def ar(m):
        return ("all-reduce", 2, m)

    ag, rs = ("all-gather", 1, act), ("reduce-scatter", 1, act)
    if t == 1:
        return [], []
    if layer in ("attention", "mlp"):  # (ln_1, out_proj bias) or (ln_2, fc_out bias)
        if sequence_parallel:
            return [ag, rs], [rs, ag] + [ar(h * e)] * (3 if bias else 1)
        return [ar(act)], [ar(act)]
    if layer == "embedding":
        if sequence_parallel:
            return [rs], [ag, ar((table_rows or s) * h * e)]
        return [ar(act)], []
    if layer == "head":
        loss = [ar(b * s * 4)] * 3  # max, sum of exponentials, target logit
        if sequence_parallel:
            return [ag] + loss, [rs] + [ar(h * e)] * (2 if bias else 1)
        return loss, [ar(act)]
    raise ValueError(f"layer must be one of {LAYERS}, got {layer!r}")


def total_bytes(entries, tp_size) -> dict:
    """{"collectives" (sorted names), "message_bytes", "ring_bytes" (sent per rank)}."""
    t = tp_size
    return {"collectives": sorted(n for n, _, _ in entries),
            "message_bytes": sum(m for _, _, m in entries),
            "ring_bytes": sum(round(k * (t - 1) / t * m) for _, k, m in entries)}


def block_communication_bytes(batch, seq_len, d_model, tp_size, sequence_parallel=False,
                              bias=True, bytes_per_element=4) -> dict:
    """Per direction ("forward", "backward"): one block's collectives — attention's and the
    MLP's — their message bytes and the bytes one rank sends on a ring (0 for t = 1)."""
    args = (batch, seq_len, d_model, tp_size, sequence_parallel, bias, None, bytes_per_element)
    (af, ab), (mf, mb) = layer_collectives("attention", *args), layer_collectives("mlp", *args)
    return {"forward": total_bytes(af + mf, tp_size), "backward": total_bytes(ab + mb, tp_size)}


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


def layer_activation_bytes(layer, batch, seq_len, d_model, n_head, d_ff=None, vocab_size=64,
                           tp_size=1, sequence_parallel=False, bytes_per_element=4) -> int:
    """Bytes one rank saves for backward in one layer (no dropout), the terms of
    ``block_activation_bytes_tp`` by layer: attention and mlp each hold their LayerNorm's
    input and statistics (split by t with sequence parallelism), the gathered input of
    the column layer(s), and their share of the rest; the embedding its int64 token ids
    (masked to this rank's rows), the fp32 mask zeroing the others, and int64 positions;
    the head ln_f's input and statistics, the head's input, the loss's softmax over this
    rank's vocabulary slice, int64 target indices and a 1-byte "target is mine" flag."""
    b, s, h, a, t, e = batch, seq_len, d_model, n_head, tp_size, bytes_per_element
    f, v = (4 * h if d_ff is None else d_ff), vocab_size
    sp = t if sequence_parallel else 1
    norm = (s * b * h * e + 8 * s * b) // sp  # a LayerNorm's input and mean, 1/std
    if layer == "attention":
        return norm + s * b * h * e + (4 * s * b * h * e + a * s * s * b * e) // t
    if layer == "mlp":
        return norm + s * b * h * e + 2 * s * b * f * e // t
    if layer == "embedding":
        return 8 * b * s + 4 * b * s + 8 * s // sp
    if layer == "head":
        return norm + s * b * h * e + 4 * b * s * v // t + 8 * b * s + b * s
    raise ValueError(f"layer must be one of {LAYERS}, got {layer!r}")


def _layout(model, dense, rank, t) -> dict:
    """Per parameter: ("split", dim, start, stop, full) — found by matching the shard against
    the dense weight, so it is what the module really holds — or ("replicated",)."""
    dense_params, out = dict(dense.named_parameters()), {}
    for name, p in model.named_parameters():
        d = dense_params[name]
        dims = [i for i in range(d.dim()) if d.shape[i] != p.shape[i]]
        if not dims:
            out[name] = ("replicated",)
            continue
        dim, size = dims[0], p.shape[dims[0]]
        starts = [k * size for k in range(t) if torch.equal(d.narrow(dim, k * size, size), p)]
        out[name] = ("split", dim, starts[0], starts[0] + size, d.shape[dim])
    return out


def _rank_layers(config_kwargs, batch, sequence_parallel):
    """On each rank: per layer, its collectives forward and backward and its saved bytes;
    the parameter layout of the whole model."""
    import copy

    import torch.distributed as dist

    from minitrain.model import GPT, GPTConfig
    from minitrain.tensor_parallel import apply_tensor_parallel, vocab_parallel_cross_entropy

    torch.manual_seed(0)
    config = GPTConfig(**config_kwargs)
    device = get_device()
    with torch.device(device):  # built where this rank computes
        dense = GPT(config)
    with torch.no_grad():  # no zero biases or unit gains: every shard is told apart by value
        for p in dense.parameters():
            p.normal_()
    model = apply_tensor_parallel(copy.deepcopy(dense), sequence_parallel=sequence_parallel)
    rank, t = dist.get_rank(), dist.get_world_size()
    g = torch.Generator(device="cpu").manual_seed(1)  # CPU numbers, moved to the device
    s_local = config.seq_len // t if sequence_parallel else config.seq_len
    idx = torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=g,
                        device="cpu").to(device)
    block = model.blocks[0]
    runs = {
        "embedding": (model.embed, idx),
        "attention": (lambda x: block.attn(block.ln_1(x)), None),
        "mlp": (lambda x: block.mlp(block.ln_2(x)), None),
        "head": (lambda x: vocab_parallel_cross_entropy(model.logits(x), idx), None),
    }
    layers = {}
    for name, (fn, arg) in runs.items():
        if arg is None:
            arg = torch.randn(batch, s_local, config.d_model, generator=g, device="cpu").to(device)
            arg.requires_grad_()
        saved = saved_activation_bytes(fn, arg)
        mappings.reset_communication_log()
        y = fn(arg)
        forward = mappings.communication_log()
        mappings.reset_communication_log()
        y.backward(torch.ones_like(y))
        layers[name] = {"forward": forward, "backward": mappings.communication_log(),
                        "activation_bytes": saved}
    return {"layers": layers, "layout": _layout(model, dense, rank, t)}


def measure_layers(config_kwargs: dict, batch: int, tp_size: int, sequence_parallel=False,
                   timeout: float = 120.0) -> dict:
    """Every layer of the TP GPT on ``tp_size`` ranks: {"layers": {layer: {"forward",
    "backward" (rank 0's logs), "activation_bytes" (one per rank)}}, "layout": one dict per
    rank (see ``_layout``)}."""
    results = launch(_rank_layers, tp_size, config_kwargs, batch, sequence_parallel,
                     timeout=timeout)
    layers = results[0]["layers"]
    for name in layers:
        layers[name]["activation_bytes"] = [r["layers"][name]["activation_bytes"] for r in results]
    return {"layers": layers, "layout": [r["layout"] for r in results]}


def _rank_measure(config_kwargs, batch, sequence_parallel):
    """On each rank: one block's collectives forward and backward, its saved bytes."""
    import torch.distributed as dist

    from minitrain.model import GPT, GPTConfig
    from minitrain.runtime import trace
    from minitrain.tensor_parallel import apply_tensor_parallel

    torch.manual_seed(0)
    config = GPTConfig(**config_kwargs)
    device = get_device()
    with torch.device(device):  # built where this rank computes
        model = apply_tensor_parallel(GPT(config), sequence_parallel=sequence_parallel)
    t, s = dist.get_world_size(), config.seq_len
    x = torch.randn(batch, s // t if sequence_parallel else s, config.d_model, device="cpu",
                    generator=torch.Generator(device="cpu").manual_seed(1)).to(device)
    block = model.blocks[0]
    out = {"activation_bytes": saved_activation_bytes(block, x)}
    x.requires_grad_()
    for _ in range(2):  # warm-up: a process's first backward costs ~0.7 s of one-off set-up
        y = block(x)
        y.backward(torch.ones_like(y))
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
    return {"collectives": sorted(n for n, _, _ in log),
            "message_bytes": sum(m for _, m, _ in log), "ring_bytes": sum(r for _, _, r in log)}
