"""Benchmark: tokens/s and model FLOPs utilisation (MFU) of minitrain's training step.

``python -m minitrain.bench mfu [--peak-gflops G] [--threads T] [--steps N]``

Chapter 1 (notebooks/01_single_device_training.ipynb). FLOPs per token are
6N + 12 L h s (``minitrain.step.flops_per_token``); MFU is that times tokens/s over
the peak. The default peak is the device's (``minitrain.step.peak_flops``: an A100, H100 or
H200's data-sheet fp32 peak; on the CPU this course machine's per thread, AMD EPYC Zen 4: two
256-bit FMA pipes = 32 fp32 FLOPs/cycle at 3.7 GHz = 118.4 GFLOP/s); pass another device's.
A large matmul is timed too: the share of the peak reachable at all. Medians of N steps.
"""

from __future__ import annotations

import statistics

import torch

from minitrain.bench import bench_parser
from minitrain.data import MarkovChainData
from minitrain.model import GPT, GPTConfig
from minitrain.runtime import device_clock, get_device
from minitrain.step import flops_per_token, mfu, peak_flops, train_step

CONFIGS = [  # (name, config, batch)
    ("tiny", GPTConfig(), 32),
    ("h256", GPTConfig(seq_len=128, n_layer=4, n_head=8, d_model=256), 8),
    ("h512", GPTConfig(seq_len=256, n_layer=4, n_head=8, d_model=512), 4),
]

__all__ = ["main", "peak_flops"]  # peak_flops lives in minitrain.step, beside mfu


def main(argv=None) -> int:
    parser = bench_parser("mfu", __doc__, steps=7)
    parser.add_argument(
        "--peak-gflops",
        type=float,
        default=None,
        help="peak GFLOP/s per thread (CPU) or of the device (GPU); default: the device's",
    )
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = get_device()
    per_unit = args.peak_gflops * 1e9 if args.peak_gflops else peak_flops(device, torch.float32)
    peak = per_unit * (args.threads if device.type == "cpu" else 1)
    print(f"device {device}, {args.threads} thread(s), assumed peak {peak / 1e9:.1f} GFLOP/s")

    a = torch.randn(1024, 1024, device=device)
    times = []
    for _ in range(args.steps):
        t0 = device_clock(device)  # on a GPU: once the queued work is done
        a @ a
        times.append(device_clock(device) - t0)
    rate = 2 * 1024**3 / statistics.median(times)
    print(f"matmul 1024^3: {rate / 1e9:.1f} GFLOP/s, ratio to peak {rate / peak:.2f}")

    for name, config, batch in CONFIGS:
        torch.manual_seed(0)
        with torch.device(device):  # built where it computes, not moved there
            model = GPT(config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = MarkovChainData(config.vocab_size, config.seq_len)
        rates = []
        for step in range(args.steps + 1):
            x, y = data.get_batch(step, batch, device=device)
            stats = train_step(model, opt, x, y)  # times itself with device_clock
            rates.append(stats.tokens_per_second)
        tps = statistics.median(rates[1:])  # the first step warms up
        fpt = flops_per_token(config)
        print(
            f"{name}: {tps:,.0f} tokens/s, {fpt:,d} FLOPs/token, "
            f"{tps * fpt / 1e9:.1f} GFLOP/s, MFU {mfu(tps, fpt, peak):.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
