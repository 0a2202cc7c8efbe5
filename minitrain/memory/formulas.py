"""Where the memory of a training step goes: model states, activations, and their timeline.

Used by notebooks/01_single_device_training.ipynb. Two kinds of memory (Rajbhandari et
al. 2020, "ZeRO", section 3):

- *model states*: weights, gradients and optimizer state, a fixed number of bytes per
  parameter (``estimate_training_memory``);
- *activations*: the tensors autograd saves during forward for use in backward; they
  grow with batch and sequence (``saved_activation_bytes`` measures them, and
  ``block_activation_bytes`` predicts them the way Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models", section 4.1, derive
  sbh(34 + 5as/h) — here for minitrain's block in fp32).

``memory_timeline`` follows all of them through forward -> backward -> optimizer step.

Files: this one has the predictions (the bytes-per-parameter table, ``estimate_training_memory``,
``block_activation_bytes``, ``model_activation_bytes``); measuring (``saved_activation_bytes``,
``LiveSavedBytes``, ``memory_timeline``) is ``minitrain/memory/measure.py``. Every name of
both is importable from ``minitrain.memory``.
"""

from __future__ import annotations

# ------------------------------------------------------------------ bytes per parameter
# The one table of training-state bytes per parameter, with Adam (chapters 1, 2 and 5 read it).
# The three recipes of Megatron-LM's distributed-optimizer guide (non-distributed column):
# fp32: 4 (weights) + 4 (gradients) + 8 (Adam's two fp32 moments) = 16.
# mixed_fp32_grads: 2 (bf16/fp16 weights) + 4 (fp32 gradients: Megatron's `main_grad`, into
#   which backward accumulates directly) + 4 (fp32 master weights) + 8 (fp32 moments) = 18.
#   What minitrain's MasterWeightOptimizer keeps between steps: each 16-bit gradient is moved
#   into the master's fp32 `.grad` as soon as it is final and freed.
# mixed: 2 (16-bit weights) + 2 (their 16-bit gradients, kept) + 4 (fp32 master) + 8 (fp32
#   moments) + 4 (the fp32 copy the 16-bit gradients are summed into before the update) = 20.
#   Micikevicius et al. 2018 give the master weights and fp32 update; ZeRO (Rajbhandari et al.
#   2020, section 3.1) counts the same recipe as 2 + 2 + K, K = 12, leaving out the fp32 copy.
# bf16: everything, moments included, in bf16 and no master copy.
# fp8: "mixed" with the weights the matmuls read cached in fp8; fp8_lean follows FP8-LM (Peng
#   et al. 2023): fp8 weights and gradients, fp16 master weights, an fp8 first and an fp16
#   second moment.
BYTES_PER_PARAMETER: dict[str, dict[str, int]] = {
    "fp32": {"weights": 4, "gradients": 4, "master": 0, "optimizer": 8, "gradient_accumulation": 0},
    "mixed_fp32_grads": {"weights": 2, "gradients": 4, "master": 4, "optimizer": 8,
                         "gradient_accumulation": 0},
    "mixed": {"weights": 2, "gradients": 2, "master": 4, "optimizer": 8, "gradient_accumulation": 4},
    "bf16": {"weights": 2, "gradients": 2, "master": 0, "optimizer": 4, "gradient_accumulation": 0},
    "fp8": {"weights": 1, "gradients": 2, "master": 4, "optimizer": 8, "gradient_accumulation": 4},
    "fp8_lean": {"weights": 1, "gradients": 1, "master": 2, "optimizer": 3, "gradient_accumulation": 0},
}


def bytes_per_parameter(recipe: str) -> dict[str, int]:
    """Bytes of training state per parameter for ``recipe`` (a key of ``BYTES_PER_PARAMETER``),
    by component, plus "total"."""
    if recipe not in BYTES_PER_PARAMETER:
        raise ValueError(f"unknown recipe {recipe!r}; choose one of {sorted(BYTES_PER_PARAMETER)}")
    parts = dict(BYTES_PER_PARAMETER[recipe])
    parts["total"] = sum(parts.values())
    return parts


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


def model_activation_bytes(
    config, batch: int, seq_len: int | None = None, bytes_per_element: int = 4
) -> int:
    """Bytes ``GPT(config).loss(idx, targets)`` saves for backward (exact in fp32).

    ``n_layer`` blocks plus: the int64 token ids and positions (the embeddings' backward
    needs them), the embedding dropout mask, ln_f's input and statistics, the head's
    input, the fp32 log-softmax output (b s v), the int64 targets and the loss's 4-byte
    normaliser. Assumes contiguous ``idx``/``targets`` of shape (batch, seq_len).
    """
    b, s, e = batch, seq_len or config.seq_len, bytes_per_element
    h, v = config.d_model, config.vocab_size
    blocks = config.n_layer * block_activation_bytes(
        b, s, h, config.n_head, config.d_ff, config.dropout, e
    )
    embed = 8 * b * s + 8 * s + (b * s * h if config.dropout > 0 else 0)
    head = 2 * e * b * s * h + 2 * b * s * 4  # ln_f and head inputs, ln_f statistics
    loss = 4 * b * s * v + 8 * b * s + 4
    return blocks + embed + head + loss
