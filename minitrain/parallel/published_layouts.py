"""Published training layouts and their hardware, to hold the planner against.

Chapter 11, notebooks/11_putting_it_together.ipynb and docs/ch11_putting_it_together.md.

- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", Table 1: GPT models of 1.7B–1T parameters on up to 3072 A100-80GB GPUs (8 per
  DGX node, NVSwitch; 8 × 200 Gb/s HDR InfiniBand per node), sequence 2048, vocabulary 51200,
  mixed precision, full activation recomputation, tensor (t) and pipeline (p) parallelism,
  no ZeRO. Hardware: 312 TFLOP/s bf16 peak, NVLink 300 GB/s per direction, 25 GB/s per GPU
  across nodes.
- Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.2 and Table 4: Llama 3 405B
  (126 layers, width 16384, 128 heads, SwiGLU FFN 53248, vocabulary 128256) on 16384 H100-80GB
  (989 TFLOP/s bf16 dense; NVLink 450 GB/s per direction; 400 Gb/s RoCE = 50 GB/s per GPU),
  sequence 8192, 16M tokens per batch: TP8, CP1, PP16, DP128 (and CP16 at sequence 131072).

The course's GPT has a two-matrix GELU MLP: a SwiGLU FFN of width f has 3hf weights, so it is
modelled with d_ff = 1.5 f (same parameters and FLOPs); grouped-query attention's smaller k, v
projections are not modelled (a few per cent more attention weights here).
"""

from __future__ import annotations

from minitrain.model import GPTConfig
from minitrain.parallel.planner import Cluster

GB = 1e9


def a100_cluster(devices: int) -> Cluster:
    return Cluster(devices, 8, 80 * GB, 300 * GB, 25 * GB, 312e12, mfu=0.45)


def h100_cluster(devices: int) -> Cluster:
    return Cluster(devices, 8, 80 * GB, 450 * GB, 50 * GB, 989e12, mfu=0.40)


# (name, heads, hidden, layers, GPUs, batch, published t, published p) — Table 1
MEGATRON_2021 = [
    ("1.7B", 24, 2304, 24, 32, 512, 1, 1),
    ("3.6B", 32, 3072, 30, 64, 512, 2, 1),
    ("7.5B", 32, 4096, 36, 128, 512, 4, 1),
    ("18.4B", 48, 6144, 40, 256, 1024, 8, 1),
    ("39.1B", 64, 8192, 48, 512, 1536, 8, 2),
    ("76.1B", 80, 10240, 60, 1024, 1792, 8, 4),
    ("145.6B", 96, 12288, 80, 1536, 2304, 8, 8),
    ("310.1B", 128, 16384, 96, 1920, 2160, 8, 16),
    ("529.6B", 128, 20480, 105, 2520, 2520, 8, 35),
    ("1008.0B", 160, 25600, 128, 3072, 3072, 8, 64),
]


def published_cases() -> list[dict]:
    """Every published case: name, model, seq_len, batch, cluster, published layout."""
    cases = []
    for name, heads, h, layers, gpus, batch, t, p in MEGATRON_2021:
        cases.append({"name": f"Megatron-LM {name}", "seq_len": 2048, "batch": batch,
                      "model": GPTConfig(vocab_size=51200, seq_len=2048, n_layer=layers,
                                         n_head=heads, d_model=h),
                      "cluster": a100_cluster(gpus),
                      "published": {"tp": t, "pp": p, "cp": 1, "dp": gpus // (t * p)}})
    llama = GPTConfig(vocab_size=128256, seq_len=8192, n_layer=126, n_head=128, d_model=16384,
                      d_ff=int(1.5 * 53248))
    cases.append({"name": "Llama 3 405B", "seq_len": 8192, "batch": 2048, "model": llama,
                  "cluster": h100_cluster(16384),
                  "published": {"tp": 8, "pp": 16, "cp": 1, "dp": 128}})
    return cases
