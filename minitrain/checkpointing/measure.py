"""Measuring chapter 3: what each checkpointing policy really saves and costs.

Used by notebooks/03_activation_checkpointing.ipynb, its widget (minitrain.widgets.ch03_checkpointing)
and its benchmark (``python -m minitrain.bench checkpointing``): per policy on the tiny GPT,
the bytes saved for backward, the peak of live saved bytes, the matmul FLOPs of a step and
its wall time, each next to its formula (cost.py).

How peak memory is measured: CPU tensors have no allocator statistics, and the bytes
that matter here are the ones autograd *holds for backward*. ``LiveSavedBytes`` (chapter
1's ``minitrain.memory``) is a ``saved_tensors_hooks`` pair, here active through forward
*and* backward. pack() counts the storage of every saved tensor (parameters excluded, a
storage saved several times counted once) and returns a small holder; autograd drops the
holder when the node that saved it has run its backward, and a ``weakref.finalize`` on the
holder then uncounts it. Recomputation inside backward packs through the same hooks, so the
bytes of a recomputed segment show up while they live: the peak is the true high-water mark.
"""

from __future__ import annotations

import contextlib
import copy
import statistics

import torch
from torch.utils.flop_counter import FlopCounterMode

from minitrain.checkpointing.cost import (
    policy_extra_flops,
    policy_saved_bytes,
    segment_sizes,
    sequential_peak_bytes,
)
from minitrain.checkpointing.function import checkpoint_sequential
from minitrain.checkpointing.policies import set_checkpointing
from minitrain.memory import LiveSavedBytes, saved_activation_bytes
from minitrain.model import GPT, GPTConfig
from minitrain.runtime import device_clock, get_device


@contextlib.contextmanager
def single_thread():
    """Run tiny models on one intra-op thread: on a shared 2-core CPU, two threads per
    small op spend more time waiting for each other than computing (measured 8x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def tiny_setup(n_layer=4, batch=16, dropout=0.1, seed=0, **config):
    """A GPT, a batch of token ids and targets, all from ``seed``."""
    torch.manual_seed(seed)
    cfg = GPTConfig(n_layer=n_layer, dropout=dropout, **config)
    device = get_device()
    with torch.device(device):  # built where it computes; the data drawn on the CPU, moved
        model = GPT(cfg).train()
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), device="cpu").to(device)
    targets = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), device="cpu").to(device)
    return model, idx, targets


def train_step_once(model, idx, targets, seed=1):
    """One forward + backward of the GPT's loss, dropout seeded so every policy matches."""
    torch.manual_seed(seed)  # same dropout masks for every policy
    model.zero_grad(set_to_none=True)
    model.loss(idx, targets).backward()


def track_step(model, idx, targets, seed=1) -> LiveSavedBytes:
    """One forward + backward under ``LiveSavedBytes``; returns the tracker."""
    tracker = LiveSavedBytes(model.parameters())
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    with tracker:
        loss = model.loss(idx, targets)
        tracker.phase = "backward"
        loss.backward()
        del loss
    return tracker


def step_flops(model, idx, targets) -> int:
    """Matmul FLOPs of one forward + backward, counted by torch's FlopCounterMode."""
    with FlopCounterMode(display=False) as counter:
        train_step_once(model, idx, targets)
    return counter.get_total_flops()


def interleaved_seconds(fns, repeats: int, warmup: int = 2, device=None) -> list[float]:
    """Median seconds of each fn, timing them in turns so a busy machine slows all alike
    (on ``device``, default this rank's: a GPU's queued work is waited for)."""
    device = device or get_device()
    for fn in fns:
        for _ in range(warmup):
            fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            t0 = device_clock(device)
            fn()
            ts.append(device_clock(device) - t0)
    return [statistics.median(ts) for ts in times]


def measure_policy(model, idx, targets, policy, k=1) -> dict:
    """Measured and predicted saved bytes, peak and FLOPs of a policy (on a copy of model)."""
    cfg, batch = model.config, idx.shape[0]
    model = set_checkpointing(copy.deepcopy(model), policy, k)
    tracker = track_step(model, idx, targets)
    torch.manual_seed(1)
    return {
        "policy": policy if policy in ("none", "full", "selective") else f"{policy}({k})",
        "model": model,
        "saved": saved_activation_bytes(model.loss, idx, targets),
        "saved_formula": policy_saved_bytes(cfg, batch, policy, k),
        "peak": tracker.peak,
        "flops": step_flops(model, idx, targets),
        "extra_flops_formula": policy_extra_flops(cfg, batch, policy, k),
        "timeline": tracker.timeline,
    }


def compare_policies(model, idx, targets, policies, repeats=0) -> list[dict]:
    """``measure_policy`` for each (policy, k), with ratios to the first one (``none``).

    With ``repeats``, also the median step time (``seconds``) and ``time_ratio``.
    """
    with single_thread():
        rows = [measure_policy(model, idx, targets, p, k) for p, k in policies]
        if repeats:
            steps = [lambda m=row["model"]: train_step_once(m, idx, targets) for row in rows]
            for row, seconds in zip(rows, interleaved_seconds(steps, repeats)):
                row["seconds"] = seconds
    base = rows[0]
    for row in rows:
        del row["model"]
        row["extra_flops"] = row["flops"] - base["flops"]
        row["saved_ratio"] = row["saved"] / base["saved"]
        row["flops_ratio"] = row["flops"] / base["flops"]
        if repeats:
            row["time_ratio"] = row["seconds"] / base["seconds"]
    return rows


class TanhLinear(torch.nn.Module):
    """A chain layer saving exactly one input-sized tensor: tanh's output (= the Linear's input)."""

    def __init__(self, width):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        return self.linear(torch.tanh(x))


def chain_sweep(num_layers=64, width=64, batch=16, seed=0) -> list[dict]:
    """Peak live saved bytes of ``checkpoint_sequential`` over a chain, for k = 1..L.

    Each layer saves A = c = batch * width * 4 bytes (Chen et al.'s setting), the loss
    (a sum) saves nothing, so the formula is sequential_peak_bytes(L, k, c, c).
    """
    torch.manual_seed(seed)
    with torch.device(get_device()):
        layers = torch.nn.Sequential(*(TanhLinear(width) for _ in range(num_layers)))
    x = torch.randn(batch, width, device="cpu").to(get_device()).requires_grad_()
    c = x.nbytes
    rows = []
    for k in range(1, num_layers + 1):
        tracker = LiveSavedBytes(layers.parameters())
        with single_thread(), tracker:
            loss = checkpoint_sequential(layers, k, x).sum()
            loss.backward()
            del loss
        rows.append(
            {
                "segments": k,
                "peak": tracker.peak,
                "formula": sequential_peak_bytes(num_layers, k, c, c),
            }
        )
    return rows


def segment_sweep(model, idx, targets, repeats=0) -> list[dict]:
    """Policy "segments" for k = 1..L on the GPT: peak and saved bytes, FLOPs, time."""
    num_layers = len(model.blocks)
    rows = compare_policies(
        model, idx, targets, [("segments", k) for k in range(1, num_layers + 1)], repeats
    )
    for k, row in enumerate(rows, start=1):
        row["segments"] = k
        row["last_segment"] = segment_sizes(num_layers, k)[-1]
    return rows


POLICY_SET = [("none", 1), ("full", 1), ("every_k", 2), ("selective", 1), ("segments", 2)]
