"""Benchmark of chapter 9: ``python -m minitrain.bench flash [--sizes 256 512 1024 2048 4096]``.

Per sequence length N, on (1, 4, N, 64) fp32 causal attention: the bytes each version saves
for backward (flash against its O(N d) formula, naive against its O(N^2) one, SDPA's fused
kernel measured) and the time of
forward plus backward of minitrain's PyTorch tiles, of naive attention and of torch's
scaled_dot_product_attention, the reference (its fused CPU kernel), with the ratios. Target:
the tiles within 3x of SDPA at N >= 1024. The measuring functions are
minitrain.flash_attention.measure's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minitrain.bench import bench_parser, print_table
from minitrain.flash_attention import flash_attention
from minitrain.flash_attention.measure import forward_backward_seconds, saved_bytes
from minitrain.memory import saved_activation_bytes
from minitrain.model import naive_attention
from minitrain.runtime import get_device


def sdpa(q, k, v, causal):
    """The reference, used only here and in the tests: torch's fused attention."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def main(argv=None) -> int:
    parser = bench_parser("flash", __doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--naive-up-to", type=int, default=2048,
                        help="largest N naive attention is timed at (its N x N scores)")
    args = parser.parse_args(argv)
    rows = []
    for n in args.sizes:
        b = saved_bytes(n, d=64, heads=4, batch=1)
        qkv = [torch.randn(1, 4, n, 64, device=get_device(), requires_grad=True) for _ in range(3)]
        sdpa_bytes = saved_activation_bytes(sdpa, *qkv, True)
        fns = {"flash": flash_attention, "sdpa": sdpa}
        if n <= args.naive_up_to:
            fns["naive"] = naive_attention
        t = forward_backward_seconds(fns, n, d=64, heads=4, repeats=args.repeats)
        rows.append({
            "N": n, "flash MB": b["flash"] / 2**20, "= formula": b["flash"] == b["flash_formula"],
            "naive MB": b["naive"] / 2**20, "= formula ": b["naive"] == b["naive_formula"],
            "sdpa MB": sdpa_bytes / 2**20,
            "flash ms": 1e3 * t["flash"], "sdpa ms": 1e3 * t["sdpa"],
            "naive ms": 1e3 * t["naive"] if "naive" in t else "-",
            "flash/sdpa": t["flash"] / t["sdpa"],
            "naive/sdpa": t["naive"] / t["sdpa"] if "naive" in t else "-",
        })
        print(f"N={n} done", flush=True)
    print("causal attention, batch 1, 4 heads, head dim 64, fp32; forward + backward, median of "
          f"{args.repeats} interleaved runs")
    print_table(rows, list(rows[0]))
    worst = max((r["flash/sdpa"] for r in rows if r["N"] >= 1024), default=None)
    if worst is not None:
        print(f"PyTorch tiles within 3x of SDPA at N >= 1024: {worst < 3} (worst ratio {worst:.2f})")
    return 0
