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
