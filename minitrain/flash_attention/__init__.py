"""FlashAttention (chapter 9, notebooks/09_flash_attention.ipynb): tiled attention with an
online softmax and a recomputing backward, in PyTorch tiles and in Triton kernels.

Files by role: ``tiles.py`` (the algorithms, Dao 2023 Algorithms 1 and 2), ``function.py``
(the autograd Function and the model's attention_fn), ``triton_kernels.py`` (the same in
Triton), ``io_model.py`` (HBM reads/writes, Dao et al. 2022 Theorem 2), ``measure.py``.
"""

from minitrain.flash_attention.function import (
    FlashAttentionFunction,
    flash_attention,
    flash_attention_fn,
)
from minitrain.flash_attention.tiles import (
    TileLog,
    flash_attention_backward,
    flash_attention_forward,
)

__all__ = [
    "FlashAttentionFunction",
    "FlashAttentionTritonFunction",
    "TileLog",
    "flash_attention",
    "flash_attention_backward",
    "flash_attention_fn",
    "flash_attention_forward",
]


def __getattr__(name):
    # Triton is imported on first use only: importing it reads TRITON_INTERPRET, which a
    # CPU test must be able to set first, and the PyTorch tiles need no Triton at all.
    if name == "FlashAttentionTritonFunction":
        from minitrain.flash_attention.triton_kernels import FlashAttentionTritonFunction

        return FlashAttentionTritonFunction
    raise AttributeError(f"module 'minitrain.flash_attention' has no attribute {name!r}")
