"""A layout planner: which DP × TP × PP × CP × ZeRO × checkpointing × micro-batch layout to run.

Chapter 11, notebooks/11_putting_it_together.ipynb (and its widget). Given a model, a sequence
length, a global batch and a cluster (devices, devices per node, memory per device, intra- and
inter-node bandwidth, peak FLOP/s), ``plan`` enumerates layouts, predicts each one's memory per
device and step time from the formulas of the earlier chapters, drops what does not fit and
ranks the rest by time. Each fact comes from its chapter's public function:

- bytes per parameter of a recipe (chapter 1/2, ``minitrain.memory``) sharded by ZeRO stage
  (chapter 5, ``minitrain.zero.memory_formula``; Rajbhandari et al. 2020, Figure 1);
- activation bytes per layer and rank under TP/SP (chapter 6,
  ``tensor_parallel.measure.layer_activation_bytes``; Korthikanti et al. 2022, section 4);
  full recomputation keeps one block input per layer (chapter 3);
- in-flight micro-batches: GPipe all m, 1F1B p - stage on stage ``stage`` (chapter 7;
  Narayanan et al. 2021, section 2.2), and the pipeline bubble (p - 1)/m;
- communication time from chapter 4's α–β ring model (``cost_model.predict_all_reduce``),
  with intra-node bandwidth for a group that fits in a node and inter-node otherwise;
- compute: 6N + 12Lhs FLOPs per token (chapter 1, ``step.flops_per_token``; + one
  forward, 4/3, with full recomputation) at an assumed MFU;
- mixture of experts (chapter 8): each rank holds E/ep experts per layer (replicated over
  tp), a token runs k of them, and expert parallelism's four all-to-alls per layer and
  micro-batch move ``moe.measure.all_to_all_bytes_formula`` bytes each;
- precision: "fp32", or "bf16" / "fp16" / "mixed" (low-precision compute, fp32 masters:
  chapter 2's recipe, ``minitrain.memory``'s bytes per parameter).

The model is the course's GPT (``GPTConfig``): for another architecture pass a GPTConfig with
the same width, depth, heads, vocabulary and an MLP width ``d_ff`` giving the same parameters.
The layouts themselves (``Layout``, ``enumerate_layouts``) are ``layouts.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from minitrain.collectives.cost_model import predict_all_reduce
from minitrain.model import GPTConfig
from minitrain.moe.measure import all_to_all_bytes_formula
from minitrain.parallel.layouts import Layout, enumerate_layouts, layout_dict  # noqa: F401
from minitrain.pipeline import split_blocks
from minitrain.step import flops_per_token
from minitrain.tensor_parallel.measure import layer_activation_bytes
from minitrain.zero import memory_formula

BYTES_PER_ELEMENT = {"fp32": 4, "mixed": 2, "bf16": 2, "fp16": 2}  # activations, messages


def recipe(precision: str) -> str:
    """The memory recipe of a ``--precision``: fp32, or mixed (bf16/fp16 + fp32 masters)."""
    if precision not in BYTES_PER_ELEMENT:
        raise ValueError(f"precision must be one of {sorted(BYTES_PER_ELEMENT)}, got "
                         f"{precision!r}")
    return "fp32" if precision == "fp32" else "mixed"


@dataclass(frozen=True)
class Cluster:
    """The hardware: bandwidths in bytes/s per device, memory in bytes, α in seconds."""

    devices: int
    devices_per_node: int
    memory_per_device: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    peak_flops: float
    mfu: float = 0.5
    alpha: float = 10e-6


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


def moe_params_per_rank(config: GPTConfig, layout: Layout, stage: int = 0) -> tuple[int, int]:
    """(parameters replicated over dp × cp, expert parameters) one rank of ``stage`` holds:
    with experts, each block's MLP becomes a router (h·E, replicated) and E/ep experts of
    the dense MLP's shape, whole on every TP rank (chapter 11's choice)."""
    n = params_per_rank(config, layout.tp, layout.pp, stage)
    if not config.moe_experts:
        return n, 0
    h, f, t, b = config.d_model, config.d_ff, layout.tp, 1 if config.bias else 0
    layers = len(split_blocks(config.n_layer, layout.pp)[stage])
    mlp = 2 * h * f + b * (f + h)
    n += layers * (h * config.moe_experts - (2 * h * f // t + b * (f // t + h)))
    return n, layers * (config.moe_experts // layout.ep) * mlp


def in_flight(layout: Layout, stage: int) -> int:
    """Micro-batches whose activations a stage holds at once (chapter 7): GPipe all m,
    1F1B at most p - stage; without a pipeline one (accumulation frees each)."""
    if layout.pp == 1:
        return 1
    if layout.schedule == "gpipe":
        return layout.microbatches
    return min(layout.microbatches, layout.pp - stage)


def activation_bytes(config: GPTConfig, layout: Layout, seq_len: int, global_batch: int,
                     stage: int = 0, precision: str = "fp32") -> int:
    """Bytes one rank of ``stage`` saves for backward at its peak (no dropout)."""
    lo, e = layout, BYTES_PER_ELEMENT[recipe(precision)]
    mb = global_batch // (lo.dp * lo.microbatches)
    s = seq_len // lo.cp  # context parallelism: each rank holds s / cp positions
    args = dict(batch=mb, seq_len=s, d_model=config.d_model, n_head=config.n_head,
                d_ff=config.d_ff, vocab_size=config.vocab_size, tp_size=lo.tp,
                sequence_parallel=lo.sequence_parallel, bytes_per_element=e)
    # an MoE layer keeps k experts' MLP activations per token (routing's few bytes left out)
    k = config.moe_top_k if config.moe_experts else 1
    block = layer_activation_bytes("attention", **args) + k * layer_activation_bytes("mlp", **args)
    layers = len(split_blocks(config.n_layer, lo.pp)[stage])
    if lo.checkpointing == "full":  # one block input per layer; one block live in backward
        kept = mb * s * config.d_model * e // (lo.tp if lo.sequence_parallel else 1)
        per_mb, extra = layers * kept, block
    else:
        per_mb, extra = layers * block, 0
    tokens = mb * s
    if stage == 0:
        per_mb += layer_activation_bytes("embedding", **args)
        if lo.tp == 1:  # a dense embedding keeps no fp32 mask of "rows this rank owns"
            per_mb -= 4 * tokens
    if stage == lo.pp - 1:
        per_mb += layer_activation_bytes("head", **args)
        if lo.tp == 1:  # a dense loss keeps a 4-byte normaliser, not a 1-byte "mine" flag
            per_mb += 4 - tokens
    return in_flight(layout, stage) * per_mb + extra


def memory_per_device(config: GPTConfig, layout: Layout, seq_len: int, global_batch: int,
                      precision: str = "fp32") -> dict:
    """Bytes per device of the fullest pipeline stage: params, grads, optimizer (ZeRO shards
    them over the DP × CP ranks), activations, and their total."""
    best = None
    # the first stage holds the embedding, the most blocks and (1F1B) the most micro-batches;
    # the last the head and loss: one of the two is the fullest
    for stage in sorted({0, layout.pp - 1}):
        n, experts = moe_params_per_rank(config, layout, stage)
        replicas = layout.dp * layout.cp
        states = memory_formula(n, replicas, layout.zero, recipe(precision))
        # the experts' replicas are the expert-data-parallel ranks (dp × cp / ep)
        expert_states = memory_formula(experts, replicas // layout.ep, layout.zero,
                                       recipe(precision))
        mem = {k: states[k] + expert_states[k] for k in ("params", "grads", "optimizer")}
        mem["activations"] = activation_bytes(config, layout, seq_len, global_batch, stage,
                                              precision)
        mem["total"] = sum(mem.values())
        mem["stage"] = stage
        if best is None or mem["total"] > best["total"]:
            best = mem
    return best


def _bandwidth(cluster: Cluster, stride: int, size: int) -> float:
    """A group of ``size`` ranks ``stride`` apart stays in one node if it spans ≤ a node."""
    inside = stride * size <= cluster.devices_per_node
    return cluster.intra_node_bandwidth if inside else cluster.inter_node_bandwidth


def step_time(config: GPTConfig, layout: Layout, seq_len: int, global_batch: int,
              cluster: Cluster, precision: str = "mixed") -> dict:
    """Predicted seconds per step: compute at ``cluster.mfu``, the pipeline bubble, and each
    group's communication (not overlapped: an upper bound) — the messages the course's trainer
    sends, on the busiest rank (``tests/test_planner_link.py`` adds them up on a modeled
    link)."""
    lo, c, e = layout, cluster, BYTES_PER_ELEMENT[recipe(precision)]
    a, h = c.alpha, config.d_model
    recompute = 4 / 3 if lo.checkpointing == "full" else 1.0
    per_token = flops_per_token(config, seq_len)
    if config.moe_experts:  # k experts of the MLP's size, and the router, per token
        mlp = 2 * h * config.d_ff
        per_token += 6 * config.n_layer * ((config.moe_top_k - 1) * mlp + h * config.moe_experts)
    flops = per_token * global_batch * seq_len * recompute
    out = {"compute": flops / (c.devices * c.peak_flops * c.mfu)}
    out["bubble"] = out["compute"] * (lo.pp - 1) / lo.microbatches
    mb = global_batch // (lo.dp * lo.microbatches)
    act = mb * (seq_len // lo.cp) * h * e  # one micro-batch's hidden states on a rank
    stages = split_blocks(config.n_layer, lo.pp)
    layers = max(len(r) for r in stages)
    # TP: 2 all-reduces forward, 2 backward per layer and micro-batch (+2 when recomputing);
    # at the ends, the vocab-parallel embedding's forward one (first stage), the head input's
    # backward one and the loss's three of one fp32 per token (last stage); the busiest stage
    per_layer = 4 + (2 if lo.checkpointing == "full" else 0)
    beta_tp = 1 / _bandwidth(c, 1, lo.tp)
    hidden, loss = (predict_all_reduce("ring", n, lo.tp, a, beta_tp)
                    for n in (act, 4 * mb * (seq_len // lo.cp)))
    out["tp"] = lo.microbatches * max(
        (per_layer * len(blocks) + (s == 0) + (s == lo.pp - 1)) * hidden
        + 3 * (s == lo.pp - 1) * loss for s, blocks in enumerate(stages))
    # CP: ring attention passes this TP rank's K and V heads round the ring, forward P − 1
    # times, backward P − 1 times and their dK, dV P times (the last hop home: chapter 10)
    beta_cp = 1 / _bandwidth(c, lo.tp, lo.cp)
    kv = 2 * act / lo.tp
    out["cp"] = (layers * lo.microbatches * (3 * lo.cp - 2) * (a + kv * beta_cp)
                 if lo.cp > 1 else 0.0)
    # PP: the busiest stage's sends: a middle one sends each micro-batch's activation forward
    # and its gradient backward, the last one the gradients and the step's loss (one float64
    # to every other stage), the first one the activations
    beta_pp = 1 / _bandwidth(c, lo.tp * lo.cp * lo.dp, lo.pp)
    hop = a + act * beta_pp
    out["pp"] = (max(2 * lo.microbatches * hop * (lo.pp > 2),
                     lo.microbatches * hop + (lo.pp - 1) * (a + 8 * beta_pp))
                 if lo.pp > 1 else 0.0)
    # EP: dispatch and combine forward, the same two backward, per MoE layer and micro-batch
    tokens = mb * (seq_len // lo.cp)
    beta_ep = 1 / _bandwidth(c, lo.tp, lo.ep)
    sent = all_to_all_bytes_formula(tokens, config.moe_top_k, h, e, lo.ep)
    out["ep"] = (4 * layers * lo.microbatches * (a + sent * beta_ep)
                 if config.moe_experts and lo.ep > 1 else 0.0)
    shares = [moe_params_per_rank(config, lo, s) for s in range(lo.pp)]
    grads, expert_grads = (max(n for n, _ in shares) * e, max(x for _, x in shares) * e)
    beta_dp = 1 / _bandwidth(c, lo.tp, lo.cp * lo.dp)
    edp = lo.dp * lo.cp // lo.ep  # the experts' replicas, ep · tp ranks apart
    beta_edp = 1 / _bandwidth(c, lo.tp * lo.ep, edp)
    volume = 1.5 if lo.zero == 3 else 1.0  # ZeRO §7: 3Ψ instead of 2Ψ
    out["dp"] = volume * predict_all_reduce("ring", grads, lo.dp * lo.cp, a, beta_dp)
    if expert_grads:  # expert parallelism's own all-reduce, over the expert-data-parallel ranks
        out["dp"] += volume * predict_all_reduce("ring", expert_grads, edp, a, beta_edp)
    out["total"] = sum(out.values())
    return out


def plan(config: GPTConfig, seq_len: int, global_batch: int, cluster: Cluster,
         precision: str = "mixed", top: int | None = 10, **enumerate_kw) -> list[dict]:
    """Layouts that fit ``cluster.memory_per_device``, fastest first: dicts with "layout",
    "memory" (bytes by part) and "time" (seconds by part)."""
    rows = []
    for lo in enumerate_layouts(config, seq_len, global_batch, cluster.devices,
                                cluster.devices_per_node, **enumerate_kw):
        mem = memory_per_device(config, lo, seq_len, global_batch, precision)
        if mem["total"] > cluster.memory_per_device:
            continue
        rows.append({"layout": lo, "memory": mem,
                     "time": step_time(config, lo, seq_len, global_batch, cluster, precision)})
    rows.sort(key=lambda r: (r["time"]["total"], r["memory"]["total"]))
    return rows[:top] if top else rows
