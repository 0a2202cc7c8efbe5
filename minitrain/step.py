"""One training step: forward, backward, optimizer step, with gradient accumulation; its FLOPs.

Used by notebooks/01_single_device_training.ipynb and the chapters that train after it.

- Batch sizes: global batch = micro-batch x gradient-accumulation steps x data-parallel
  ranks (GBS = MBS x GA x DP). A rank runs GA micro-batches of MBS sequences through
  forward and backward, letting ``.grad`` sum, then steps once.
- Cost: a dense transformer spends 6N + 12 L h s FLOPs per token in forward + backward,
  the form of Chowdhery et al. 2022 ("PaLM", appendix B): 2 FLOPs per multiply-add for
  each of the N matrix weights forward, twice that backward, plus per layer the full
  s x s attention scores q k^T and their weighted sum of v (2 s h each forward, so
  3 x 4 s h = 12 s h per layer for the step). Kaplan et al. 2020 (Table 1) count
  2N + 2 L s d_attn forward and 6N + 6 L s d_attn for a step: half the attention term,
  what a causal kernel that skips the masked half of the scores computes. minitrain's
  naive attention computes every score, masked ones included, so the PaLM form is what
  torch's FlopCounterMode counts. Model FLOPs utilisation (MFU) is the achieved FLOP
  rate over the hardware's peak.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minitrain.model import GPTConfig, lm_loss
from minitrain.runtime import device_clock


def gradient_accumulation_steps(global_batch: int, micro_batch: int, dp: int = 1) -> int:
    """GA such that global_batch = micro_batch x GA x dp; raises if it does not divide."""
    if global_batch < 1 or micro_batch < 1 or dp < 1:
        raise ValueError(
            f"batch sizes must be positive: global_batch={global_batch}, "
            f"micro_batch={micro_batch}, dp={dp}"
        )
    if global_batch % (micro_batch * dp):
        raise ValueError(
            f"global_batch={global_batch} is not a multiple of micro_batch={micro_batch} x dp={dp}"
        )
    return global_batch // (micro_batch * dp)


def split_micro_batches(x: torch.Tensor, y: torch.Tensor, micro_batch_size: int) -> list:
    """[(x_i, y_i), ...]: the rows of (x, y) in consecutive chunks of micro_batch_size."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
    return list(zip(x.split(micro_batch_size), y.split(micro_batch_size)))


def accumulate_gradients(model, micro_batches, loss_fn=None) -> float:
    """Forward and backward over every micro-batch, summing gradients in ``.grad``.

    ``micro_batches``: a list of (inputs, targets) pairs, of any sizes (the last may be
    smaller); ``loss_fn(logits, targets)`` (default ``lm_loss``) returns the *mean* loss over
    its targets. Afterwards each parameter's ``.grad`` has gained the gradient of the mean
    loss over *all* targets of all micro-batches — exactly what one backward of the whole
    batch would give (the grader compares with that, to 1e-9 in float64, with unequal
    micro-batches too). Returns that mean loss, a Python float.

    Does not zero ``.grad`` first: the caller decides (DDP's ``no_sync`` relies on that).
    Each micro-batch's graph is freed by its own backward before the next forward: holding
    one micro-batch's activations at a time is the point of accumulating.
    """
    ### BEGIN SOLUTION
    loss_fn = loss_fn or lm_loss
    total = sum(y.numel() for _, y in micro_batches)
    if total == 0:
        raise ValueError("accumulate_gradients needs at least one non-empty micro-batch")
    mean_loss = 0.0
    for x, y in micro_batches:
        loss = loss_fn(model(x), y) * (y.numel() / total)
        loss.backward()  # adds into .grad; the graph of this micro-batch is freed now
        mean_loss += loss.item()
    return mean_loss
    ### END SOLUTION


@dataclass
class StepStats:
    loss: float
    tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def train_step(
    model, optimizer, x, y, micro_batch_size: int | None = None, loss_fn=None
) -> StepStats:
    """One optimizer step on this rank's batch (x, y), in micro-batches of micro_batch_size."""
    start = device_clock(x.device)  # on a GPU: once the queued work is done
    optimizer.zero_grad(set_to_none=True)
    micro = split_micro_batches(x, y, micro_batch_size or x.shape[0])
    loss = accumulate_gradients(model, micro, loss_fn)
    optimizer.step()
    return StepStats(loss, x.numel(), device_clock(x.device) - start)


def train(
    model,
    optimizer,
    data,
    steps: int,
    batch_size: int,
    micro_batch_size: int | None = None,
    first_step: int = 0,
) -> list[float]:
    """Train for ``steps`` steps on ``data.get_batch(step, batch_size)``; the losses."""
    model.train()
    device = next(model.parameters()).device
    losses = []
    for step in range(first_step, first_step + steps):
        x, y = data.get_batch(step, batch_size, device=device)
        losses.append(train_step(model, optimizer, x, y, micro_batch_size).loss)
    return losses


def matmul_params(config: GPTConfig) -> int:
    """Weights that multiply activations: L (4h^2 + 2hf) in the blocks + v h in the head.

    Embedding lookups, biases and LayerNorm gains cost no matmul FLOPs, so they are the
    part of ``gpt_num_params`` that 6N leaves out.
    """
    h, f = config.d_model, config.d_ff
    return config.n_layer * (4 * h * h + 2 * h * f) + config.vocab_size * h


def flops_per_token(config: GPTConfig, seq_len: int | None = None) -> int:
    """Training FLOPs per token: 6 N + 12 L h s (N = ``matmul_params``; PaLM's appendix B).

    Forward: 2 N for the weight matmuls, and per layer 2 s h for q k^T and 2 s h for
    probs @ v (naive attention computes all s x s scores, masked ones included; Kaplan et
    al.'s Table 1 counts half of these two, 6 L s h for the step).
    Backward does each matmul twice (gradient of input and of weight): 2x forward in
    FLOPs. In time only where the matmuls dominate: on small matrices the elementwise
    ops and per-op overheads weigh as much, and backward comes out below 2x.
    """
    s = seq_len or config.seq_len
    return 6 * matmul_params(config) + 12 * config.n_layer * config.d_model * s


def mfu(tokens_per_second: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the device's peak FLOP/s."""
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be positive, got {peak_flops}")
    return tokens_per_second * flops_per_token / peak_flops


# ------------------------------------------------------------------ the peak it is measured against
CPU_PEAK_FLOPS = 118.4e9  # one core of this course's machine (AMD EPYC Zen 4): 2 FMA pipes x
# 8 fp32 lanes x 2 FLOPs x 3.7 GHz; ``python -m minitrain.bench mfu`` measures what a matmul reaches

# Dense peaks (no 2:4 sparsity), FLOP/s, from NVIDIA's data sheets. "fp32" is the CUDA cores'
# (TF32 tensor cores are faster, but only if torch is allowed to use them); fp16 = bf16.
# Matched against torch.cuda.get_device_name in order: the specific variants first.
GPU_PEAK_FLOPS = {
    "H200": {"bf16": 989e12, "fp32": 67e12},
    "H100 PCIe": {"bf16": 756e12, "fp32": 51e12},
    "H100 NVL": {"bf16": 835e12, "fp32": 60e12},
    "H100": {"bf16": 989e12, "fp32": 67e12},  # SXM5
    "A100": {"bf16": 312e12, "fp32": 19.5e12},  # SXM4 and PCIe alike
}
_KIND = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "bf16"}


def peak_flops(device, dtype: torch.dtype = torch.float32) -> float:
    """The peak FLOP/s of one ``device`` computing in ``dtype``: what MFU divides by.

    A GPU's is its data sheet's dense peak (A100, H100, H200; ``GPU_PEAK_FLOPS``); the CPU's
    is one core of the course machine (``CPU_PEAK_FLOPS``), whatever the dtype. Another GPU
    raises, naming it: pass the peak yourself (``--peak-flops``)."""
    device = torch.device(device)
    if device.type == "cpu":
        return CPU_PEAK_FLOPS
    if dtype not in _KIND:
        raise ValueError(f"peak_flops: no peak for dtype {dtype} (fp32, bf16, fp16)")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    for fragment, peaks in GPU_PEAK_FLOPS.items():
        if fragment in name:
            return peaks[_KIND[dtype]]
    raise ValueError(
        f"peak_flops: no known peak for {name!r} ({device}); known: {', '.join(GPU_PEAK_FLOPS)}"
        " — pass the device's peak FLOP/s (--peak-flops)"
    )
