"""Measurements of chapter 9 (used by the notebook, the widget and ``python -m minitrain.bench
flash``): bytes saved for backward, HBM traffic recorded by the tiles, time of forward plus
backward — each next to its formula or its reference.

What it teaches (notebooks/09_flash_attention.ipynb): FlashAttention saves O(N d) bytes
for backward where naive attention saves the O(N²) probabilities (Dao et al. 2022, section
3.1), and the HBM traffic its tiles record equals ``io_model.tiled_io`` (FlashAttention-2's
loop order; Theorem 2's count of Algorithm 1 is ``io_model.algorithm1_io``).
"""

from __future__ import annotations

import torch

from minitrain.checkpointing.measure import interleaved_seconds
from minitrain.flash_attention.function import flash_attention
from minitrain.flash_attention.io_model import causal_tiles, tiled_io
from minitrain.flash_attention.tiles import TileLog, flash_attention_forward
from minitrain.memory import saved_activation_bytes
from minitrain.model import naive_attention
from minitrain.runtime import get_device


def _inputs(batch, heads, n, d, dtype=torch.float32, seed=0):
    # from the CPU generator (the same numbers on every device), moved to this rank's device
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(batch, heads, n, d, generator=g, dtype=dtype, device="cpu").to(get_device())
            .requires_grad_()
            for _ in range(3)]


def flash_saved_bytes_formula(batch: int, heads: int, n: int, d: int, bytes_per_element: int = 4) -> int:
    """q, k, v, out (4 N d) in the input dtype and the fp32 logsumexp (N) per head: O(N d)."""
    return batch * heads * (4 * n * d * bytes_per_element + 4 * n)


def naive_saved_bytes_formula(batch: int, heads: int, n: int, d: int, bytes_per_element: int = 4) -> int:
    """minitrain's ``naive_attention``: q, k, v (3 N d) and the probabilities P (N²) per head."""
    return batch * heads * (3 * n * d + n * n) * bytes_per_element


def saved_bytes(n: int, d: int = 64, batch: int = 1, heads: int = 4, causal: bool = True) -> dict:
    """Bytes autograd keeps for backward (``minitrain.memory.saved_activation_bytes``), flash
    and naive, next to their formulas."""
    q, k, v = _inputs(batch, heads, n, d)
    return {
        "n": n,
        "flash": saved_activation_bytes(flash_attention, q, k, v, causal),
        "flash_formula": flash_saved_bytes_formula(batch, heads, n, d),
        "naive": saved_activation_bytes(naive_attention, q, k, v, causal),
        "naive_formula": naive_saved_bytes_formula(batch, heads, n, d),
    }


def recorded_io(n_q: int, n_k: int, d: int, block_q: int, block_k: int, causal: bool = False) -> dict:
    """Run ``flash_attention_forward`` on one head with a ``TileLog`` and return what it
    recorded next to ``io_model.tiled_io`` and ``io_model.causal_tiles``."""
    g = torch.Generator(device="cpu").manual_seed(0)  # a count of tiles: the CPU is enough
    q = torch.randn(n_q, d, generator=g, device="cpu")
    k, v = (torch.randn(n_k, d, generator=g, device="cpu") for _ in range(2))
    log = TileLog()
    flash_attention_forward(q, k, v, causal, block_q, block_k, log)
    formula = tiled_io(n_q, n_k, d, block_q, block_k, causal)
    tiles = causal_tiles(n_q, n_k, block_q, block_k) if causal else None
    return {"reads": log.reads, "writes": log.writes, "tiles": log.tiles, "skipped": log.skipped,
            "formula_reads": formula["reads"], "formula_writes": formula["writes"],
            "formula_tiles": tiles["computed"] if tiles else -(-n_q // block_q) * -(-n_k // block_k),
            "formula_skipped": tiles["skipped"] if tiles else 0}


def forward_backward_seconds(attentions: dict, n: int, d: int = 64, batch: int = 1, heads: int = 4,
                             causal: bool = True, repeats: int = 3) -> dict:
    """Median seconds of forward plus backward of each ``attentions[name](q, k, v, causal)``
    on (batch, heads, n, d) fp32 inputs, timed in turns (``interleaved_seconds``) so a busy
    machine slows them all alike."""
    q, k, v = _inputs(batch, heads, n, d)
    grad = torch.randn(q.shape, generator=torch.Generator(device="cpu").manual_seed(1),
                       device="cpu").to(q.device)

    def step(attention):
        return lambda: torch.autograd.grad(attention(q, k, v, causal), (q, k, v), grad)

    seconds = interleaved_seconds([step(fn) for fn in attentions.values()], repeats, warmup=1)
    return dict(zip(attentions, seconds))
