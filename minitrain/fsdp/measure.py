"""What FSDP costs, measured and predicted: bytes per rank, peak gathered bytes, bytes sent.

Chapter 5, notebooks/05_zero.ipynb; the widget (widgets/ch05_zero.py) and the benchmark
(bench/zero.py) call these. Zhao et al. 2023 (PyTorch FSDP, "Sharding Strategies"): with parameters, gradients
and optimizer state sharded, a rank keeps 1/N of the model states — ZeRO-3's (4 + 4 + 8)Ψ/N
in fp32 (Rajbhandari et al. 2020, §5, Figure 1) — plus, for a moment, the units it has
gathered: the current one and the prefetched one, never the model (prefetching). Per step it sends
two all-gathers and one reduce-scatter of Ψ: 3Ψ·(N−1)/N elements (ZeRO §7); in bf16 the two
gathers move 2-byte elements and the reduce-scatter stays fp32: (2 + 2 + 4)Ψ·(N−1)/N bytes.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from minitrain.zero.accounting import optimizer_state_tensors, storage_bytes

_BYTES = {None: 4, torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def fsdp_formula(num_params: int, world_size: int, compute_dtype=None) -> dict:
    """Bytes per rank (params, grads, optimizer, total) and bytes sent per step ("sent")
    for Ψ = ``num_params`` (padded) elements sharded over N = ``world_size`` ranks with AdamW.

    fp32: the ZeRO-3 formula, 4Ψ/N + 4Ψ/N + 8Ψ/N, sent 3·4Ψ·(N−1)/N. With a 2-byte
    ``compute_dtype`` the shard is 2Ψ/N and an fp32 master (4Ψ/N) joins the optimizer state;
    gradients stay fp32 (4Ψ/N); sent (2 + 2 + 4)Ψ·(N−1)/N."""
    if compute_dtype not in _BYTES:
        raise ValueError(f"compute_dtype must be None, float32, bfloat16 or float16, got {compute_dtype!r}")
    c, n = _BYTES[compute_dtype], world_size
    out = {
        "params": c * num_params / n,
        "grads": 4 * num_params / n,
        "optimizer": (8 + (4 if c != 4 else 0)) * num_params / n,
    }
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    out["sent"] = (2 * c + 4) * num_params * (n - 1) / n
    return out


def model_state_bytes(fsdp, optimizer) -> dict:
    """Bytes this rank keeps between steps, accounted from its tensors (not from formulas):
    params (the shards, and replicated units), grads (the shards' ``.grad``), optimizer (its
    per-element state, plus the fp32 masters when they are separate from the shards)."""
    units = fsdp.live_units()
    separate = fsdp.compute_dtype is not None
    gathered = [p for u in units for p in u.params]  # 0 bytes between steps (freed)
    state = optimizer_state_tensors(optimizer) + ([u.master for u in units] if separate else [])
    out = {
        "params": storage_bytes([u.shard for u in units] + gathered),
        "grads": storage_bytes([u.master.grad for u in units]),
        "optimizer": storage_bytes(state),
    }
    out["total"] = sum(out.values())
    return out


def predicted_peak_gathered_bytes(fsdp) -> int:
    """The most gathered bytes held at once: the root unit (embeddings, head: gathered for the
    whole forward and most of backward, as their layers bracket the blocks) plus the unit
    computing and the one prefetched — the largest pair of neighbouring blocks."""
    size = [u.padded * u.full.element_size() if u is not None else 0 for u in fsdp.units]
    blocks, root = size[:-1], size[-1]
    pairs = [a + b for a, b in zip(blocks, blocks[1:])] or blocks or [0]
    return root + max(pairs)


def one_process_reference(model, batches, compute_dtype=None, lr=1e-3, world=1):
    """What FSDP on ``world`` ranks should give, in one process: AdamW on fp32 weights; with
    ``compute_dtype`` each rank's share of each batch run on a copy cast to it, the
    gradients cast to fp32 and averaged (the casts FSDP makes). Returns the parameters
    (name → tensor) after each batch."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    out = []
    for x, y, loss_fn in batches:
        opt.zero_grad()
        if compute_dtype is None:
            loss_fn(model(x), y).backward()
        else:
            grads = [torch.zeros_like(p) for p in model.parameters()]
            for xs, ys in zip(x.chunk(world), y.chunk(world)):
                low = copy.deepcopy(model).to(compute_dtype)
                loss_fn(low(xs), ys).backward()
                for g, p in zip(grads, low.parameters()):
                    if p.grad is not None:
                        g += p.grad.float() / world
            for p, g in zip(model.parameters(), grads):
                p.grad = g
        opt.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def gpt_step_report(fsdp, optimizer, x, y) -> dict:
    """Run one training step of ``fsdp`` (a GPT) on this rank's ``(x, y)`` and return the
    numbers the notebook sets beside their formulas: model-state bytes, peak gathered bytes,
    bytes sent (counted by minitrain.zero), each with its prediction."""
    from minitrain import zero
    from minitrain.model import lm_loss

    zero.reset_bytes_sent()
    fsdp.reset_peak_gathered_bytes()
    optimizer.zero_grad()
    lm_loss(fsdp(x), y).backward()
    fsdp.finish_gradient_synchronization()
    optimizer.step()
    psi, world = fsdp.padded_numel(), dist.get_world_size(fsdp.group)
    return {
        "padded_numel": psi,
        "bytes": model_state_bytes(fsdp, optimizer),
        "formula": fsdp_formula(psi, world, fsdp.compute_dtype),
        "peak_gathered": fsdp.peak_gathered_bytes,
        "predicted_peak": predicted_peak_gathered_bytes(fsdp),
        "model_bytes": psi * _BYTES[fsdp.compute_dtype],
        "sent": zero.bytes_sent(),
    }
