"""Chapter 5 bug hunt — minitrain.zero.data_parallel.ZeroDataParallel._scaled_step (the bug as
it shipped).

fp16 training with ZeRO: each rank checks only its own shard of the gradients for inf/NaN.
Sharded and model-parallel trainers have shipped loss scalers that decided to skip a step
from the local check alone, so one rank skipped while the others stepped — and the replicas
silently drifted apart.

What you see: An overflow in one rank's shard: that rank halves its loss scale and skips;
the other rank steps and keeps its scale. After a few steps the ranks' scales differ from
torch.amp.GradScaler's and their weights are no longer one model.

Your tools: notebook 05's parity check (full_state_dict on every rank against one process),
`scaler.get_scale()` per rank, and torch.amp.GradScaler as the reference.

One line of the function below is wrong or missing. Fix it in
my_exercises/bughunt05_loss_scaler.py (run `python -m minitrain.exercises start` once), then
`python -m minitrain.grade 5` re-runs the broken scenario.
"""

# ruff: noqa: F405 (the library module's names come from the star import)
from __future__ import annotations

from minitrain.zero.data_parallel import *  # noqa: F403 — the module's names, as the library sees them


class ZeroDataParallel:
    # Only the method with the bug; the rest of the class is in minitrain.zero.data_parallel.

    def _scaled_step(self):
        """Dynamic loss scaling over shards (skipping: Micikevicius et al. 2018, §3.2; growing and
        backing off: NVIDIA Apex, as GradScaler): a rank sees its slice of the gradients only, so
        an overflow may show on one rank alone. The verdict is all-reduced first: all skip or step."""
        scaler = self.loss_scaler
        scaler.unscale_(self.optimizer)  # this rank's fp32 shard gradients ÷ S, its inf check
        scaler.step(self.optimizer)  # skipped on every rank, or taken on every rank
        scaler.update()

# minitrain-exercises-hash: 5cfacbab4243a332
