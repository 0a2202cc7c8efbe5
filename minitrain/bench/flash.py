"""Benchmark of chapter 9: ``python -m minitrain.bench flash [--sizes 256 512 1024 2048 4096]``.

Per sequence length N, on (1, 4, N, 64) fp32 causal attention: the bytes each version saves
for backward (flash against its O(N d) formula, naive against its O(N^2) one, SDPA's fused
kernel measured) and the time of
forward plus backward of minitrain's PyTorch tiles, of naive attention and of torch's
scaled_dot_product_attention, the reference (its fused CPU kernel), with the ratios; then,
side by side with SDPA, the median of per-pair ratios (flash / SDPA, timed in turns) and the
largest difference of the output and the three gradients. Targets: the tiles within 3x of
SDPA at N >= 1024 (chapter 9); within 1.3x (issue 33's fused tiles). The measuring
functions are minitrain.flash_attention.measure's.
"""

from __future__ import annotations

import statistics
import time

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


def side_by_side(n: int, pairs: int = 8, d: int = 64, heads: int = 4) -> dict:
    """Forward + backward of flash and SDPA on (1, heads, n, d) fp32 causal inputs, timed in
    turns after one warm-up each: medians (s), the median of per-pair ratios, and the max
    |flash - SDPA| over the output and dq, dk, dv."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, d, generator=g, device="cpu", requires_grad=True)
               for _ in range(3))
    grad = torch.randn(1, heads, n, d, generator=g, device="cpu")

    def run(fn):
        start = time.perf_counter()
        out = fn(q, k, v, True)
        grads = torch.autograd.grad(out, (q, k, v), grad)
        return time.perf_counter() - start, [out.detach(), *grads]

    (_, ours), (_, ref) = run(flash_attention), run(sdpa)
    diff = max((a - b).abs().max().item() for a, b in zip(ours, ref))
    t_flash, t_sdpa = [], []
    for _ in range(pairs):
        t_flash.append(run(flash_attention)[0])
        t_sdpa.append(run(sdpa)[0])
    ratios = [a / b for a, b in zip(t_flash, t_sdpa)]
    return {"N": n, "flash ms": 1e3 * statistics.median(t_flash),
            "sdpa ms": 1e3 * statistics.median(t_sdpa), "flash/sdpa": statistics.median(ratios),
            "max |diff|": diff}


def main(argv=None) -> int:
    parser = bench_parser("flash", __doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=8,
                        help="side-by-side pairs (flash, SDPA) per N for the ratio")
    parser.add_argument("--side-by-side-only", action="store_true",
                        help="only the side-by-side table")
    parser.add_argument("--naive-up-to", type=int, default=2048,
                        help="largest N naive attention is timed at (its N x N scores)")
    args = parser.parse_args(argv)
    rows = []
    for n in [] if args.side_by_side_only else args.sizes:
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
    if rows:
        print("causal attention, batch 1, 4 heads, head dim 64, fp32; forward + backward, median "
              f"of {args.repeats} interleaved runs")
        print_table(rows, list(rows[0]))
        worst = max((r["flash/sdpa"] for r in rows if r["N"] >= 1024), default=None)
        if worst is not None:
            print(f"PyTorch tiles within 3x of SDPA at N >= 1024: {worst < 3} (worst ratio {worst:.2f})")
    pairs = [side_by_side(n, args.pairs) for n in args.sizes if n >= 512]
    if pairs:
        print(f"\nside by side with SDPA (median of {args.pairs} per-pair ratios, "
              f"{torch.get_num_threads()} threads):")
        print_table(pairs, list(pairs[0]))
        worst = max((r["flash/sdpa"] for r in pairs if r["N"] >= 1024), default=None)
        if worst is not None:
            print(f"fused tiles within 1.3x of SDPA at N >= 1024: {worst <= 1.3} (worst {worst:.2f})")
    return 0
