"""Chapter 1 solutions — generated from minitrain.model, minitrain.memory.formulas, minitrain.step.

The worked answers. Look one up when you are stuck; the library has them too.
"""

from __future__ import annotations

import math
import torch
import torch.nn.functional as F
from contextlib import nullcontext
from dataclasses import dataclass
from torch import nn
from minitrain.dropout import DropoutKeys, DropoutSite, dropout_site
from minitrain.memory.formulas import BYTES_PER_PARAMETER
from minitrain.model import GPTConfig, lm_loss
from minitrain.moe.apply import apply_moe
from minitrain.runtime import device_clock


def gpt_num_params(config: GPTConfig) -> int:
    """Exact number of parameters of ``GPT(config)``, counted from the config alone.

    Returns an int equal to ``sum(p.numel() for p in GPT(config).parameters())`` (a tensor
    shared by two modules counted once) for every config: any ``d_ff``, with and without
    ``config.bias``, with ``config.tie_weights``, and with ``config.moe_experts`` > 0 (every
    block's MLP is then chapter 8's mixture of experts, built by ``apply_moe``). What each
    module holds is in this file's classes (``Block``, ``CausalSelfAttention``, ``MLP``,
    ``GPT``) and in ``minitrain.moe``; the notebook derives the dense count before this
    exercise — reproduce it from the code, not from a model you build (the chapter uses it
    for sizes no machine here could allocate).
    """
    ### BEGIN SOLUTION
    h, f, v, s, L = (config.d_model, config.d_ff, config.vocab_size, config.seq_len, config.n_layer)
    b = 1 if config.bias else 0
    attention = 4 * h * h + b * 4 * h  # q, k, v, out projections
    mlp = 2 * h * f + b * (f + h)  # fc_in, fc_out
    if config.moe_experts:  # a router, and E expert MLPs that always have biases
        mlp = config.moe_experts * (h + 2 * h * f + f + h)
    norms = 2 * (h + b * h)  # ln_1, ln_2 (the gain always, the bias if bias)
    per_block = attention + mlp + norms
    embeddings = v * h + s * h
    final_norm = h + b * h
    head = 0 if config.tie_weights else v * h  # the head has no bias
    return embeddings + L * per_block + final_norm + head
    ### END SOLUTION


def estimate_training_memory(num_params: int, precision: str = "fp32") -> dict:
    """Bytes of model states for training ``num_params`` parameters with Adam.

    Returns a dict of ints with the keys weights, gradients, master, optimizer (Adam's two
    moments), gradient_accumulation and total (total = the sum of the other five), each
    ``num_params`` times that part's bytes per parameter in ``precision``'s recipe:
    - "fp32": everything in fp32, no separate master copy;
    - "mixed" (Micikevicius et al. 2018): 16-bit weights and their 16-bit gradients, fp32
      master weights and moments, and an fp32 buffer the 16-bit gradients are summed into
      before the fp32 update ("gradient_accumulation");
    - "mixed_fp32_grads" and the others of chapter 2: the keys of ``BYTES_PER_PARAMETER``,
      whose comment describes each recipe — this function accepts exactly those names.
    ``BYTES_PER_PARAMETER`` holds every recipe's bytes per parameter and you may use it —
    after you have worked out fp32's and mixed's yourself (the notebook asks you to).

    Bad input raises ``ValueError`` naming the value given (a ``KeyError`` from a dict lookup
    tells the caller nothing): ``num_params`` must be a whole number ≥ 0 (a float such as
    7e9 with no fractional part has already been turned into an int above), ``precision``
    one of the recipes, spelled exactly ("FP32" is not one).
    """
    if isinstance(num_params, float) and num_params.is_integer():
        num_params = int(num_params)  # 7e9 is a fine way to write seven billion
    ### BEGIN SOLUTION
    if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 0:
        raise ValueError(f"num_params must be a non-negative int, got {num_params!r}")
    if precision not in BYTES_PER_PARAMETER:
        raise ValueError(
            f"precision must be 'fp32' or 'mixed' (or another of {sorted(BYTES_PER_PARAMETER)}), "
            f"got {precision!r}"
        )
    parts = {name: per * num_params for name, per in BYTES_PER_PARAMETER[precision].items()}
    parts["total"] = sum(parts.values())
    return parts
    ### END SOLUTION


def block_activation_bytes(
    batch: int,
    seq_len: int,
    d_model: int,
    n_head: int,
    d_ff: int | None = None,
    dropout: float = 0.0,
    bytes_per_element: int = 4,
) -> int:
    """Bytes one minitrain ``Block`` saves for backward: a prediction from the sizes alone.

    Arguments: b = ``batch``, s = ``seq_len``, h = ``d_model``, a = ``n_head``,
    ``d_ff`` (None: 4h), ``dropout`` (the block's probability p, training mode),
    ``bytes_per_element`` (e: 4 for fp32 activations). Returns an int equal to the bytes of
    the distinct non-parameter tensors autograd saves when ``Block(...)`` runs forward in
    training mode on an input of shape (b, s, h) — what ``minitrain.memory``'s
    ``saved_activation_bytes`` measures (each storage counted once, the block's input
    included; the grader compares with exactly that measurement, for several sizes and with
    dropout). Facts of the block you may rely on: minitrain's ``dropout`` saves a bool mask
    (1 byte an element), and torch's LayerNorm keeps its per-token statistics in fp32
    whatever e is. Korthikanti et al. 2022 (section 4.1) derive the same count for
    Megatron's block — the notebook asks you for minitrain's first.
    """
    ### BEGIN SOLUTION
    b, s, h, a = batch, seq_len, d_model, n_head
    f = 4 * h if d_ff is None else d_ff
    e = bytes_per_element
    total = (8 * s * b * h + 2 * s * b * f + a * s * s * b) * e
    total += 2 * 2 * s * b * 4  # two LayerNorms, each saving mean and rstd in fp32
    if dropout > 0:
        total += a * s * s * b * (1 + e)  # bool mask + the dropped probabilities
        total += 2 * s * b * h  # two residual-dropout bool masks
    return total
    ### END SOLUTION


def accumulate_gradients(model, micro_batches, loss_fn=None) -> float:
    """Forward and backward over every micro-batch, summing gradients in ``.grad``.

    ``micro_batches``: a list of (inputs, targets) pairs, of any sizes (the last may be
    smaller); ``loss_fn(logits, targets)`` (default ``lm_loss``) returns the *mean* loss over
    its targets. Afterwards each parameter's ``.grad`` has gained the gradient of the mean
    loss over *all* targets of all micro-batches — exactly what one backward of the whole
    batch would give (the grader compares with that, to 1e-9 in float64, with unequal
    micro-batches too). Returns that mean loss, a Python float.

    Does not zero ``.grad`` first: the caller decides (DDP's ``no_sync`` relies on that).
    Each micro-batch's graph is freed by its own backward before the next forward: holding
    one micro-batch's activations at a time is the point of accumulating.
    """
    ### BEGIN SOLUTION
    loss_fn = loss_fn or lm_loss
    total = sum(y.numel() for _, y in micro_batches)
    if total == 0:
        raise ValueError("accumulate_gradients needs at least one non-empty micro-batch")
    mean_loss = 0.0
    for x, y in micro_batches:
        loss = loss_fn(model(x), y) * (y.numel() / total)
        loss.backward()  # adds into .grad; the graph of this micro-batch is freed now
        mean_loss += loss.item()
    return mean_loss
    ### END SOLUTION

# minitrain-exercises-hash: 9073fc3fccce8245
