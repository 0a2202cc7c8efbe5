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
    """Exact number of parameters of ``GPT(config)``.

    With h = d_model, f = d_ff, v = vocab_size, s = seq_len, L = n_layer:
    embeddings v*h + s*h; per block 4h^2 + 2hf weights (attention q, k, v, out and
    the MLP's two matrices) and the two LayerNorms' gains 2h (always there), plus, with
    biases (``config.bias``), 4h + f + h (Linear biases) + 2h (the LayerNorms' biases); the
    final LayerNorm (gain, and bias with biases); the LM head v*h (no bias) unless tied
    (``config.tie_weights``: the head *is* the token embedding, counted once). For f = 4h
    and biases: v*h + s*h + L*(12h^2 + 13h) + 2h (+ v*h). Kaplan et al. 2020, Table 1,
    count the same terms. With ``config.moe_experts`` = E > 0 every block's MLP is chapter
    8's mixture of experts instead: a router (an E x h matrix, no bias) and E experts, each
    an MLP of width f *with* its two biases whatever ``config.bias`` says. Returns an int
    equal to ``sum(p.numel() for p in GPT(config).parameters())``, for every config.
    """
    ### BEGIN SOLUTION
    # HINT: count one block, then multiply; bias=False removes biases only, never gains
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

    Returns a dict with keys weights, gradients, master, optimizer,
    gradient_accumulation and total (total = the sum of the others).
    ``precision`` names a recipe (the three of Megatron-LM's distributed-optimizer guide):
    fp32: 4 (weights) + 4 (gradients) + 8 (Adam's two moments) = 16 bytes/parameter.
    mixed_fp32_grads: 2 (16-bit weights) + 4 (fp32 gradients, Megatron's ``main_grad``)
    + 4 (fp32 master weights) + 8 (fp32 moments) = 18 — what chapter 2's
    MasterWeightOptimizer keeps.
    mixed (Micikevicius et al. 2018): 2 (16-bit weights) + 2 (16-bit gradients)
    + 4 (fp32 master weights) + 8 (fp32 moments) + 4 (fp32 gradient accumulation) = 20.
    So 1e9 parameters need 16e9 bytes in fp32, 18e9 or 20e9 mixed. "gradient_accumulation"
    is the fp32 copy "mixed" sums its 16-bit gradients into before the fp32 update; where
    the gradients are fp32 already they are that buffer, so it is 0. Master weights are 0
    in fp32 (the weights are already fp32). ``BYTES_PER_PARAMETER[precision]`` holds these
    numbers (and those of the other recipes of chapter 2). Bad input raises ValueError
    naming it.
    """
    if isinstance(num_params, float) and num_params.is_integer():
        num_params = int(num_params)  # 7e9 is a fine way to write seven billion
    ### BEGIN SOLUTION
    # HINT: first reject what cannot be counted (say which input and why); then every part
    # HINT: is bytes per parameter times the count
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
    """Bytes one minitrain ``Block`` saves for backward (b=batch, s=seq_len, h=d_model, a=n_head).

    Korthikanti et al. 2022 (section 4.1) list what each op of a block keeps; for
    minitrain's block, f = d_ff (4h by default), e = bytes_per_element (4 in fp32):
      ln_1 input, q/k/v input, q, k, v, out_proj input, ln_2 input, fc_in input: 8 sbh e
      GELU input and fc_out input: 2 sbf e
      softmax output: a s^2 b e
      each LayerNorm's mean and 1/std (two per token, kept in fp32): 2 x 2 sb x 4
      with dropout > 0: the attention-dropout mask (1 byte) and its output
      a s^2 b (1 + e), and two residual-dropout masks 2 sbh (1 byte each).
    With f = 4h, no dropout, fp32: sbh(64 + 4as/h) + 16sb. In their fp16 units with
    dropout this is sbh(34 + 5as/h) (+ the small LayerNorm statistics they omit).
    """
    ### BEGIN SOLUTION
    # HINT: list every tensor saved by LayerNorm, Linear, matmul, softmax, GELU, dropout
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

    Afterwards ``.grad`` equals the gradient of the mean loss over *all* tokens of all
    micro-batches, as one big batch would give. Each micro-batch's loss is a mean over
    its own n_i targets, so it is scaled by n_i / N (N = total targets) before backward:
    sum_i (n_i / N) mean_i = mean over all N. With equal micro-batches that is 1/GA.
    ``loss_fn(logits, targets)`` defaults to ``lm_loss``. Returns the mean loss (a float).
    Does not zero ``.grad`` first: the caller decides (DDP's no_sync relies on that).
    """
    ### BEGIN SOLUTION
    # HINT: count the targets first (targets.numel()), then backward each scaled loss
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

# minitrain-exercises-hash: f4db8d2674cf3b35
