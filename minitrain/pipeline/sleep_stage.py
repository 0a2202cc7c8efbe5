"""A calibrated-sleep pipeline stage: the GPT's parts, each action sleeping its cost.

Chapter 7, notebooks/07_pipeline_parallel.ipynb (through ``measure.run_pipelines("sleep", ...)``).
``SleepGPT``'s blocks sleep ``t_f`` in forward and ``t_b`` in autograd's backward;
``SleepStage``'s W (zero bubble's weight gradient, which runs no autograd: ``weight_grad.py``)
sleeps ``t_w``. On a GPU the sleep is a spinning kernel, so the device-timed trace sees it.
"""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import torch
from torch import nn

from minitrain.pipeline.executor import PipelineStage
from minitrain.runtime import trace

_overshoot = []
_gpu_cycles_per_second: dict = {}


def calibrated_sleep(seconds: float, device="cpu") -> None:
    """Sleep ``seconds`` on ``device``. The host: ``time.sleep`` minus its measured overshoot
    on this machine (median of a few tries). A GPU: a kernel spinning that long
    (``torch.cuda._sleep``), queued on the current stream like the compute it stands for."""
    if seconds <= 0:
        return
    if torch.device(device).type == "cuda":
        torch.cuda._sleep(int(seconds * _cycles_per_second(device)))
        return
    if not _overshoot:  # the median of five 2 ms sleeps' overshoot
        _overshoot.append(statistics.median(_overslept(0.002) for _ in range(5)))
    time.sleep(max(0.0, seconds - _overshoot[0]))


def _overslept(seconds: float) -> float:
    start = time.perf_counter()
    time.sleep(seconds)
    return time.perf_counter() - start - seconds


def _cycles_per_second(device) -> float:
    """The GPU's spin-kernel cycles per second, timed once by two events around 20 ms of it."""
    device = torch.device(device)
    if device not in _gpu_cycles_per_second:
        with torch.cuda.device(device):
            torch.cuda._sleep(1_000_000)  # warm-up: the first launch pays its set-up
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            cycles = 20_000_000  # ~20 ms at 1 GHz
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            _gpu_cycles_per_second[device] = cycles / (start.elapsed_time(end) / 1e3)
    return _gpu_cycles_per_second[device]


class _Sleep(torch.autograd.Function):
    """Identity that sleeps ``forward_s`` in forward and ``backward_s`` in backward."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        calibrated_sleep(forward_s, x.device)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        calibrated_sleep(ctx.backward_s, grad.device)
        return grad, None, None


class SleepBlock(nn.Module):
    """out = sleep(x + w): forward costs ``t_f``, the backward through autograd ``t_b`` (on
    the first stage too: the (tiny) ``w``'s gradient is behind the sleep, as an embedding's
    is behind the blocks); the weight gradient of a split backward (W) ``t_w``, slept by
    ``SleepStage``'s W, which runs no autograd (``weight_grad.py``)."""

    def __init__(self, t_f: float, t_b: float, t_w: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(()))
        self.t_f, self.t_b, self.t_w = t_f, t_b, t_w

    def forward(self, x):
        return _Sleep.apply(x + self.weight, self.t_f, self.t_b)


class SleepStage(PipelineStage):
    """A stage of ``SleepGPT``: its W sleeps its blocks' ``t_w`` (they have no GEMM)."""

    def backward_weights(self, name: str, chunk: int, work) -> None:
        with trace.span(name, "compute", self.ref_device):
            calibrated_sleep(sum(b.t_w for b in self.chunks[chunk].blocks), self.ref_device)
            work.apply()


class SleepGPT(nn.Module):
    """The GPT's parts (embed, blocks, logits) with calibrated-sleep blocks and no real work.
    One block per virtual stage, so each chunk's F, B and W cost exactly one sleep."""

    def __init__(self, n_layer: int, t_f: float, t_b: float, t_w: float = 0.0):
        super().__init__()
        self.config = SimpleNamespace(n_layer=n_layer, tie_weights=False)
        self.tok_emb, self.pos_emb = nn.Identity(), nn.Identity()
        self.blocks = nn.ModuleList(SleepBlock(t_f, t_b, t_w) for _ in range(n_layer))
        self.ln_f, self.head = nn.Identity(), nn.Identity()

    def embed(self, idx, positions=None):  # positions: the GPT's signature; nothing sits anywhere
        return idx.float().unsqueeze(-1)

    def logits(self, h):
        return torch.cat([h, -h], dim=-1)  # two "tokens": lm_loss runs as for the GPT
