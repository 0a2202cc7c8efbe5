"""Chapter 3 — activation checkpointing: forget activations in forward, recompute in backward.

Used by notebooks/03_activation_checkpointing.ipynb. Files by role:

- ``function.py``: ``checkpoint(fn, *args)`` (a ``torch.autograd.Function`` that replays the
  RNG — torch's generators and every stream the modules it runs hold, ``forward_states`` —
  so dropout recomputes exactly) and ``checkpoint_sequential(layers, segments, x)``;
- ``policies.py``: ``set_checkpointing(model, policy, k)`` on minitrain's GPT;
- ``cost.py``: the formulas — bytes saved, recomputed FLOPs, peak memory, the best segments;
- ``measure.py``: measuring each policy (used by the notebook, its widget and the benchmark).
"""

from minitrain.checkpointing.cost import (
    POLICIES,
    check_policy,
    choose_segments,
    policy_extra_flops,
    policy_peak_bytes,
    policy_saved_bytes,
    segment_sizes,
    sequential_peak_bytes,
)
from minitrain.checkpointing.function import (
    CheckpointFunction,
    checkpoint,
    checkpoint_sequential,
    forward_states,
    get_rng_state,
    run_in_order,
    set_rng_state,
)
from minitrain.checkpointing.policies import set_checkpointing

__all__ = [
    "POLICIES",
    "CheckpointFunction",
    "check_policy",
    "checkpoint",
    "checkpoint_sequential",
    "choose_segments",
    "forward_states",
    "get_rng_state",
    "policy_extra_flops",
    "policy_peak_bytes",
    "policy_saved_bytes",
    "run_in_order",
    "segment_sizes",
    "sequential_peak_bytes",
    "set_checkpointing",
    "set_rng_state",
]
