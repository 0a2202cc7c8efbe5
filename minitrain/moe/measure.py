"""What chapter 8 measures: expert load over training, all-to-all bytes against the
formula, the per-rank timeline, parameters against active parameters (notebook 08, its
widget and ``python -m minitrain.bench moe`` all call these).

- imbalance = max load / mean load over the experts (1.0 is perfect balance; E means one
  expert took everything), per step of a short training run of the MoE GPT;
- all-to-all bytes: each rank sends tokens · k · d_model · bytes · (P−1)/P in the dispatch
  and the same in the combine when routing is uniform (a fraction (P−1)/P of the
  assignments lives on other ranks; GShard, Lepikhin et al. 2020, section 2.2), counted
  logically by ``all_to_all.communication_log``;
- parameters: E experts are held, k of them run per token (Fedus et al. 2021, section 1).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minitrain.data import get_batch
from minitrain.model import GPT, GPTConfig
from minitrain.moe.all_to_all import communication_log, reset_communication_log
from minitrain.moe.apply import apply_moe, moe_layers, moe_training_loss
from minitrain.moe.expert_parallel import ExpertParallelMoE
from minitrain.moe.layer import MoELayer
from minitrain.runtime import trace
from minitrain.runtime.rank import get_device

SMALL_GPT = dict(vocab_size=64, seq_len=32, n_layer=2, n_head=4, d_model=32)


def imbalance(load: torch.Tensor) -> float:
    """max load / mean load over the experts (1.0 = perfectly balanced)."""
    load = load.float()
    return float(load.max() / load.mean()) if load.sum() > 0 else 1.0


def all_to_all_bytes_formula(tokens: int, top_k: int, d_model: int, bytes_per_element: int,
                             world: int) -> float:
    """Bytes one rank sends to the others in one all-to-all (dispatch or combine) for
    uniform routing: tokens · k · d_model · bytes · (P−1)/P."""
    return tokens * top_k * d_model * bytes_per_element * (world - 1) / world


def parameter_counts(model: torch.nn.Module) -> dict:
    """{"total": every parameter, "active": the parameters one token runs through}."""
    total = sum(p.numel() for p in model.parameters())
    idle = sum((m.num_experts - m.top_k) * m.experts.params_per_expert()
               for m in moe_layers(model))
    return {"total": total, "active": total - idle}


def train_load_history(balancing: str = "aux_loss", aux_loss_weight: float = 0.01,
                       steps: int = 60, num_experts: int = 8, top_k: int = 1,
                       capacity_factor: float | None = None, batch_size: int = 16,
                       lr: float = 1e-2, bias_update_rate: float = 0.01, seed: int = 0,
                       config: dict | None = None) -> dict:
    """Train the MoE GPT for ``steps`` steps; per step: each MoE layer's load (tokens per
    expert, counted before capacity drops: the demand), imbalance averaged over the layers,
    the fraction of assignments dropped, and the language-modelling loss."""
    torch.manual_seed(seed)
    cfg = GPTConfig(**(config or SMALL_GPT))
    model = apply_moe(GPT(cfg), num_experts, top_k, capacity_factor, seed=seed,
                      balancing=balancing, aux_loss_weight=aux_loss_weight,
                      bias_update_rate=bias_update_rate)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    history = {"load": [], "imbalance": [], "dropped": [], "loss": [], "model": model}
    for step in range(steps):
        x, y = get_batch(step, batch_size, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len,
                         seed=seed)
        loss = moe_training_loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        layers = moe_layers(model)
        loads = [torch.bincount(m.last_routing.indices.reshape(-1), minlength=num_experts)
                 for m in layers]
        history["load"].append([ld.tolist() for ld in loads])
        history["imbalance"].append(sum(imbalance(ld) for ld in loads) / len(loads))
        history["dropped"].append(sum(m.last_routing.dropped_fraction for m in layers)
                                  / len(layers))
        history["loss"].append((loss - sum(m.aux_loss for m in layers)).item())
        if balancing == "bias":
            for m in layers:
                m.router.update_bias()
    return history


def routing_table(model: torch.nn.Module, idx: torch.Tensor, world: int, layer: int = 0,
                  capacity_factor: float | None = None) -> dict:
    """Tokens each rank sends to each expert of MoE layer ``layer``, from a real forward of
    ``model`` on each rank's slice of the batch ``idx`` (as data and expert parallelism
    split it): what ``ExpertParallelMoE`` sends from rank r to expert e, since it routes each
    rank's tokens exactly as the local layer routes that slice (the tests check it).
    ``capacity_factor`` is applied for this forward only."""
    moe = moe_layers(model)[layer]
    saved, moe.router.capacity_factor = moe.router.capacity_factor, capacity_factor
    was_training = model.training
    model.eval()
    counts, dropped, assigned = [], 0, 0
    try:
        with torch.no_grad():
            for chunk in idx.chunk(world):
                model(chunk)
                r = moe.last_routing
                counts.append(r.load.tolist())
                dropped += int((~r.keep).sum())
                assigned += r.keep.numel()
    finally:
        moe.router.capacity_factor = saved
        model.train(was_training)
    return {"counts": counts, "dropped_fraction": dropped / assigned,
            "imbalance": imbalance(torch.tensor(counts, device="cpu").sum(dim=0)),
            "capacity": moe.last_routing.capacity}


def expert_parallel_step(tokens: int = 256, d_model: int = 32, d_ff: int = 64,
                         num_experts: int = 4, top_k: int = 2,
                         capacity_factor: float | None = None, seed: int = 0) -> dict:
    """Run inside ``launch``: one forward and backward of ``ExpertParallelMoE`` on this
    rank's ``tokens`` tokens; returns the bytes it sent (logical) per exchange, the formula,
    and its trace events (route / dispatch / expert compute / combine)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    device = get_device()  # the layer and the tokens where this rank computes
    local = MoELayer(d_model, d_ff, num_experts, top_k, capacity_factor, device=device)
    ep = ExpertParallelMoE.from_local(local)
    # the tokens drawn on the CPU (the same numbers everywhere), then moved to this rank's device
    gen = torch.Generator(device="cpu").manual_seed(seed + 1 + rank)
    x = torch.randn(tokens, d_model, generator=gen, device="cpu").to(device)
    x.requires_grad_()
    reset_communication_log()
    trace.reset()
    ep(x).square().mean().backward()
    ep.finish_gradient_synchronization()
    sent: dict[str, int] = {}
    for name, nbytes in communication_log():
        sent[name] = sent.get(name, 0) + nbytes
    return {"sent": sent, "events": trace.events(),
            "formula": all_to_all_bytes_formula(tokens, top_k, d_model, 4, world)}
