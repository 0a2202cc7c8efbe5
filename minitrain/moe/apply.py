"""The course GPT with its MLPs swapped for mixture-of-experts layers (chapter 8,
notebook 08).

Switch Transformer (Fedus et al. 2021) replaces the feed-forward network of (some) blocks
by an MoE layer; the training loss becomes the language-modelling loss plus every layer's
auxiliary loss (Fedus et al. 2021, section 2.2: α · N·Σ f_i·P_i per layer, α = 0.01).
``Block.forward`` already computes x + mlp(ln_2(x)), so a dropped token's 0 from the MoE
layer leaves it on the residual.
"""

from __future__ import annotations

import torch
from torch import nn

from minitrain.model import GPT
from minitrain.moe.layer import MoELayer


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
            block.mlp = MoELayer(config.d_model, config.d_ff, num_experts, top_k,
                                 capacity_factor, **router_kwargs)
    return model


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The MoE layers (local or expert-parallel) of ``model``, in order."""
    return [m for m in model.modules() if hasattr(m, "router") and hasattr(m, "experts")]


def moe_aux_loss(model: nn.Module) -> torch.Tensor:
    """The sum of every MoE layer's auxiliary loss from the last forward."""
    return sum((m.aux_loss for m in moe_layers(model)), torch.zeros(()))


def moe_training_loss(model: GPT, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Language-modelling loss plus the MoE layers' auxiliary losses."""
    return model.loss(idx, targets) + moe_aux_loss(model)
