"""Where a block's time goes, on paper: each op's FLOPs and bytes moved, its arithmetic
intensity, and the roofline of the machine it runs on (chapter 12,
notebooks/12_kernels_and_compilers.ipynb, and its widget).

An op doing F FLOPs while moving Q bytes between memory and the cores runs at most at
min(peak FLOP/s, F/Q × bandwidth) (Williams et al. 2009; chapter 9 draws it for an A100).
Below the ridge point peak/bandwidth it is memory-bound: its time is Q/bandwidth whatever
its FLOPs, and only moving fewer bytes — fusing it with its neighbours — makes it faster.

``mlp_ops`` counts the ops of a pre-norm MLP sub-block (RMSNorm → up-projection → GELU →
down-projection → residual add) on T tokens of width d, as eager PyTorch runs them (each op
reads its inputs from memory and writes its output back) and fused (the norm one kernel, the
GELU and the residual add done in the matmuls' epilogues, as Inductor and hand-written
kernels do). Counts are forward only, e bytes per element; a matmul's bytes are its two
operands and its result, each moved once (a well-tiled matmul's traffic).
"""

from __future__ import annotations

import time

import torch


def copy_bandwidth(megabytes: int = 64, repeats: int = 5) -> float:
    """This machine's memory bandwidth in bytes/s, as one core sees it: the best of
    ``repeats`` copies of a ``megabytes`` tensor (each reads and writes it: 2× its bytes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = megabytes * 2**20 // 4
        src, dst = torch.ones(n, device="cpu"), torch.empty(n, device="cpu")
        dst.copy_(src)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return 2 * n * 4 / best


def attainable(intensity: float, flops: float, bandwidth: float) -> float:
    """The roofline: the FLOP/s an op of ``intensity`` FLOP/byte can reach."""
    return min(flops, intensity * bandwidth)


def _op(name, kind, flops, bytes_moved):
    return {"name": name, "kind": kind, "flops": flops, "bytes": bytes_moved,
            "intensity": flops / bytes_moved}


def mlp_ops(tokens: int, d: int, fused: bool, e: int = 4, hidden: int | None = None) -> list:
    """The ops of one MLP sub-block's forward: [{"name", "kind" ("matmul", "elementwise",
    "norm"), "flops", "bytes", "intensity"}]. ``hidden`` defaults to 4d."""
    t, h = tokens, hidden or 4 * d
    up = _op("up-projection", "matmul", 2 * t * d * h, e * (t * d + d * h + t * h))
    down = _op("down-projection", "matmul", 2 * t * h * d, e * (t * h + h * d + t * d))
    if fused:
        # the norm reads x and the weight once, writes y once; GELU and the residual add
        # happen on the matmuls' results before they are written (their "epilogues")
        norm = _op("RMSNorm (one kernel)", "norm", 4 * t * d, e * (2 * t * d + d))
        up["flops"] += 8 * t * h  # GELU, now inside the up-projection
        down["flops"] += t * d
        down["bytes"] += e * t * d  # the residual, read by the epilogue
        for op in (up, down):
            op["intensity"] = op["flops"] / op["bytes"]
        return [norm, up, down]
    norm_ops = [  # x², mean, +ε and √ and 1/x, x·r, ·w: each a pass over memory
        _op("RMSNorm: x²", "norm", t * d, e * 2 * t * d),
        _op("RMSNorm: mean", "norm", t * d, e * (t * d + t)),
        _op("RMSNorm: rsqrt(m + ε)", "norm", 3 * t, e * 2 * t),
        _op("RMSNorm: x · r", "norm", t * d, e * (2 * t * d + t)),
        _op("RMSNorm: · w", "norm", t * d, e * (2 * t * d + d)),
    ]
    gelu = _op("GELU", "elementwise", 8 * t * h, e * 2 * t * h)
    add = _op("residual add", "elementwise", t * d, e * 3 * t * d)
    return [*norm_ops, up, gelu, down, add]


def predicted_seconds(ops: list, flops: float, bandwidth: float) -> float:
    """The roofline's time of ``ops`` run one after another: each the larger of its FLOPs at
    peak and its bytes at full bandwidth."""
    return sum(max(op["flops"] / flops, op["bytes"] / bandwidth) for op in ops)
