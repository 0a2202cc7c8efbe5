"""Chapter 2 — float formats, mixed precision and loss scaling.

Used by notebooks/02_floating_point_and_loss_scaling.ipynb. Files by role:

- ``formats.py``: ``FloatFormat`` built from its bits (decode, encode, round to nearest even)
  and the formats ``FP32, FP16, BF16, FP8_E4M3, FP8_E5M2``;
- ``loss_scaling.py``: ``DynamicLossScaler`` (torch.amp.GradScaler's rules) and
  ``fp32_lm_loss`` (the loss of low-precision logits, computed in fp32);
- ``master_weights.py``: ``MasterWeightOptimizer`` (low-precision model, fp32 masters);
- ``fp8.py``: per-tensor amax scaling, current and delayed, and a simulated FP8 linear layer.

Bytes of training state per recipe are one table, ``minitrain.memory.BYTES_PER_PARAMETER``.
"""

from minitrain.precision.formats import (
    BF16,
    FORMATS,
    FP8_E4M3,
    FP8_E5M2,
    FP16,
    FP32,
    FloatFormat,
    round_significand,
    sequential_sum,
)
from minitrain.precision.loss_scaling import DynamicLossScaler, fp32_lm_loss
from minitrain.precision.master_weights import MasterWeightOptimizer

__all__ = [
    "BF16",
    "FORMATS",
    "FP8_E4M3",
    "FP8_E5M2",
    "FP16",
    "FP32",
    "DynamicLossScaler",
    "FloatFormat",
    "MasterWeightOptimizer",
    "fp32_lm_loss",
    "round_significand",
    "sequential_sum",
]
