"""Mixture of experts (chapter 8, notebook 08): routing, load balancing and expert
parallelism over all-to-all.

Shazeer et al. 2017 (sparsely-gated MoE), Lepikhin et al. 2020 (GShard: top-2, expert
parallelism), Fedus et al. 2021 (Switch: top-1, capacity, the load-balancing loss), Zoph et
al. 2022 (ST-MoE: the router z-loss), DeepSeek-AI 2024 (DeepSeek-V3: balancing by a bias).
Files by role: ``router.py`` (top-k, capacity, the bias), ``losses.py`` (load-balancing and
z-loss), ``dispatch.py`` (sort by expert and its inverse), ``experts.py``, ``layer.py``
(``MoELayer``: a router, experts and a dispatcher), ``dispatchers.py`` (where the experts
live: ``LocalDispatcher``, ``AllToAllDispatcher``), ``all_to_all.py`` (uneven differentiable
all-to-all, split check), ``expert_parallel.py`` (``ExpertParallelMoE``: the layer with an
all-to-all dispatcher), ``apply.py`` (the GPT with MoE MLPs) and
``measure.py`` (load, bytes, parameters, timelines).
"""

from minitrain.moe.all_to_all import check_splits, communication_log, reset_communication_log
from minitrain.moe.apply import (
    apply_expert_parallel,
    apply_moe,
    expert_parallel_gradient_sync,
    moe_aux_loss,
    moe_layers,
    moe_training_loss,
    set_aux_loss_scale,
)
from minitrain.moe.dispatch import sort_by_expert, unsort
from minitrain.moe.dispatchers import AllToAllDispatcher, LocalDispatcher
from minitrain.moe.expert_parallel import ExpertParallelMoE
from minitrain.moe.experts import Experts
from minitrain.moe.layer import MoELayer
from minitrain.moe.losses import load_balancing_loss, router_z_loss
from minitrain.moe.router import Routing, TopKRouter, expert_capacity, top_k_routing

__all__ = [
    "AllToAllDispatcher",
    "LocalDispatcher",
    "ExpertParallelMoE",
    "Experts",
    "MoELayer",
    "Routing",
    "TopKRouter",
    "apply_expert_parallel",
    "apply_moe",
    "check_splits",
    "communication_log",
    "expert_capacity",
    "expert_parallel_gradient_sync",
    "load_balancing_loss",
    "moe_aux_loss",
    "moe_layers",
    "moe_training_loss",
    "reset_communication_log",
    "router_z_loss",
    "set_aux_loss_scale",
    "sort_by_expert",
    "top_k_routing",
    "unsort",
]
