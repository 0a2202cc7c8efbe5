"""ZeRO's bookkeeping: the paper's memory and communication formulas, and what was measured.

Chapter 5, notebooks/05_zero.ipynb; used by the ZeRO optimizer and wrapper.
Rajbhandari et al. 2020, §5 and Figure 1 (memory per stage) and §7 (communication volume): every
rank counts the bytes it sends per collective with the ring cost (N-1)/N of the buffer,
and the bytes of the tensors it keeps, so the notebook can set "measured" beside "formula".
"""

from __future__ import annotations

import torch
from torch import nn

from minitrain.memory import BYTES_PER_PARAMETER
from minitrain.runtime.communication_log import COMMUNICATION_LOG

# --------------------------------------------------------------------------- accounting
SOURCE = "zero"  # ZeRO's and FSDP's records in the runtime's communication log
KINDS = ("all_reduce", "reduce_scatter", "all_gather")


def count_sent(kind: str, buffer_bytes: int, world: int) -> None:
    """Bytes this rank sends for one collective on a buffer of ``buffer_bytes`` (the *full*
    buffer: reduce-scatter's input, all-gather's output), with the ring algorithms: each
    rank forwards every chunk but one, (N-1)/N of the buffer; all-reduce does that twice."""
    if kind not in KINDS:
        raise ValueError(f"count_sent: unknown collective {kind!r}; one of {KINDS}")
    share = buffer_bytes * (world - 1) // world
    sent = 2 * share if kind == "all_reduce" else share
    COMMUNICATION_LOG.record(SOURCE, kind, sent, buffer_bytes, world)


def bytes_sent() -> dict:
    """Bytes this rank sent since ``reset_bytes_sent()``, per collective and in "total"."""
    sent = {kind: COMMUNICATION_LOG.bytes_sent(SOURCE, kind) for kind in KINDS}
    return {**sent, "total": sum(sent.values())}


def reset_bytes_sent() -> None:
    COMMUNICATION_LOG.reset(SOURCE)


def memory_formula(
    num_params: int, world_size: int, stage: int, precision: str = "fp32", offload: bool = False
) -> dict:
    """Bytes per rank for parameters, gradients, optimizer state (ZeRO §5, Figure 1; stage 0 = DP).

    fp32 with Adam: 4 + 4 + 8 bytes per parameter; "mixed": the paper's 2 + 2 + K, K = 12
    (fp32 master + moments), from ``minitrain.memory.BYTES_PER_PARAMETER`` (the paper leaves
    out the fp32 gradient-accumulation buffer, which a ZeRO rank needs for its shard only).
    Stage s shards the optimizer (s ≥ 1), gradients (s ≥ 2), parameters (s = 3) by N.
    ``offload`` moves the optimizer state to the host: it leaves "optimizer", appears in "host".
    """
    if precision not in ("fp32", "mixed"):
        raise ValueError(f"precision must be 'fp32' or 'mixed', got {precision!r}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0 (plain DP), 1, 2 or 3, got {stage!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    per = BYTES_PER_PARAMETER[precision]
    p, g, k = per["weights"], per["gradients"], per["optimizer"] + per["master"]
    n = world_size
    out = {
        "params": p * num_params / (n if stage >= 3 else 1),
        "grads": g * num_params / (n if stage >= 2 else 1),
        "optimizer": k * num_params / (n if stage >= 1 else 1),
        "host": 0.0,
    }
    if offload:
        out["host"], out["optimizer"] = out["optimizer"], 0.0
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def communication_formula(
    num_params: int, world_size: int, stage: int, bytes_per_element: int = 4
) -> float:
    """Bytes each rank sends per step (ZeRO §7): 2Ψ·(N-1)/N for DP and stages 1-2, 3Ψ·(N-1)/N
    for stage 3, Ψ counted in elements times ``bytes_per_element``."""
    volumes = {0: 2, 1: 2, 2: 2, 3: 3}
    if stage not in volumes:
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    return volumes[stage] * num_params * bytes_per_element * (world_size - 1) / world_size


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view and its base count once;
    a freed storage, resized to 0, counts 0)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def optimizer_state_tensors(optimizer) -> list:
    """The optimizer's per-element state (Adam's moments); 0-dim counters ("step") are left
    out, a few bytes per tensor."""
    return [
        v
        for st in optimizer.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]


def dp_memory_bytes(module: nn.Module, optimizer) -> dict:
    """What plain data parallelism keeps per rank, accounted from its tensors."""
    params = list(module.parameters())
    return {
        "params": storage_bytes(params),
        "grads": storage_bytes(p.grad for p in params),
        "optimizer": storage_bytes(optimizer_state_tensors(optimizer)),
        "host": 0,
    }
