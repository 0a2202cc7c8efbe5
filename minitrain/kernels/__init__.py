"""Kernels, fusion and compilers (chapter 12, notebooks/12_kernels_and_compilers.ipynb).

Files by role: ``norms.py`` (RMSNorm and LayerNorm hand-fused as ``autograd.Function``s that
save only their input and one statistic per row), ``triton_norms.py`` (the same as Triton
kernels), ``chunked_loss.py`` (linear + cross-entropy chunked over tokens: the logits are
never built whole; Wijmans et al. 2024). Peak memory of any code, temporaries included, on
any device: ``minitrain.memory.LiveAllocations``.
"""

from minitrain.kernels.chunked_loss import (
    ChunkedLinearCrossEntropy,
    chunked_linear_cross_entropy,
    loss_peak_bytes,
)
from minitrain.kernels.norms import (
    LayerNormFunction,
    RMSNormFunction,
    fused_layer_norm,
    fused_rms_norm,
    norm_saved_bytes,
)

__all__ = [
    "ChunkedLinearCrossEntropy",
    "LayerNormFunction",
    "RMSNormFunction",
    "chunked_linear_cross_entropy",
    "fused_layer_norm",
    "fused_rms_norm",
    "loss_peak_bytes",
    "norm_saved_bytes",
]
