"""The course GPT with its MLPs swapped for mixture-of-experts layers (chapter 8,
notebook 08).

Switch Transformer (Fedus et al. 2021) replaces the feed-forward network of (some) blocks
by an MoE layer; the training loss becomes the language-modelling loss plus every layer's
auxiliary loss (Fedus et al. 2021, section 2.2: α · N·Σ f_i·P_i per layer, α = 0.01).
The layers built here carry their aux loss on their output's backward (``aux_loss_in_backward``),
so it still trains the routers when the blocks are activation-checkpointed (chapter 3): the
loss *value* adds it detached, its gradient comes through the layers. With M micro-batches
averaged, ``set_aux_loss_scale(model, 1 / M)``.
``Block.forward`` already computes x + mlp(ln_2(x)), so a dropped token's 0 from the MoE
layer leaves it on the residual.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from minitrain.moe.layer import MoELayer

if TYPE_CHECKING:  # annotations only: minitrain.model builds its MoE layers through this module
    from minitrain.model import GPT


def apply_moe(model: GPT, num_experts: int, top_k: int = 1,
              capacity_factor: float | None = None, every: int = 1, seed: int | None = 0,
              **router_kwargs) -> GPT:
    """Replace the MLP of every ``every``-th block by an ``MoELayer`` (in place; returned).

    The experts have the dense MLP's width d_ff, so each active expert costs what the MLP
    did (Fedus et al. 2021: more parameters at the same FLOPs per token).
    """
    config = model.config
    if seed is not None:
        torch.manual_seed(seed)
    for i, block in enumerate(model.blocks):
        if i % every == every - 1:
            # on the dense MLP's device (the model's: issue 29), never the CPU by default
            device = next(block.mlp.parameters()).device
            block.mlp = MoELayer(config.d_model, config.d_ff, num_experts, top_k,
                                 capacity_factor, device=device, **router_kwargs)
            block.mlp.aux_loss_in_backward = True
    return model


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """The weight of the next forwards' losses in the objective (1/M for M micro-batches)."""
    for m in moe_layers(model):
        m.aux_loss_scale = scale


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The MoE layers (local or expert-parallel) of ``model``, in order."""
    return [m for m in model.modules() if hasattr(m, "router") and hasattr(m, "experts")]


def _zero(model: nn.Module) -> torch.Tensor:
    """The sums' start, a 0 on the model's device (a CPU scalar beside CUDA losses would
    move the sum to the CPU: issue 29)."""
    return torch.zeros((), device=next(model.parameters()).device)


def moe_aux_loss(model: nn.Module) -> torch.Tensor:
    """The sum of every MoE layer's auxiliary loss from the last forward."""
    return sum((m.aux_loss for m in moe_layers(model)), _zero(model))


def moe_training_loss(model: GPT, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Language-modelling loss plus the MoE layers' auxiliary losses (a layer that carries its
    aux loss in backward adds only the value here, so nothing is counted twice)."""
    lm = model.loss(idx, targets)
    return lm + sum((m.aux_loss.detach() if m.aux_loss_in_backward else m.aux_loss
                     for m in moe_layers(model)), _zero(model))


def apply_expert_parallel(model: GPT, group: ProcessGroup | None = None) -> GPT:
    """Replace every ``MoELayer`` by ``ExpertParallelMoE.from_local`` over ``group`` (in
    place; returned). Each rank then feeds the model its own slice of the batch, as in data
    parallelism; after backward call ``expert_parallel_gradient_sync``."""
    from minitrain.moe.expert_parallel import ExpertParallelMoE

    for block in model.blocks:
        if isinstance(block.mlp, MoELayer):
            block.mlp = ExpertParallelMoE.from_local(block.mlp, group)
    return model


def expert_parallel_gradient_sync(model: nn.Module, group: ProcessGroup | None = None) -> None:
    """After backward: every parameter outside the experts is replicated, so its gradient is
    averaged over the group (data parallelism); the MoE layers do their own (router averaged,
    experts divided by P). Then the gradients equal the local model's for the mean loss."""
    layers = moe_layers(model)
    experts = {id(p) for m in layers for p in m.experts.parameters()}
    routers = {id(p) for m in layers for p in m.router.parameters()}
    world = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None and id(p) not in experts and id(p) not in routers:
            dist.all_reduce(p.grad, group=group)
            p.grad /= world
    for m in layers:
        m.finish_gradient_synchronization()
