"""The learning-rate schedule of ``python -m minitrain.train``: linear warm-up, then cosine decay.

Chapter 11, notebooks/11_putting_it_together.ipynb and the README's "Train at scale". A pure
function of the step, so a resumed run continues the schedule from the step it restarts at
(nothing about the schedule is saved but its flags, which a resume must repeat).
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "cosine")


def lr_at(step: int, lr: float, total_steps: int, schedule: str = "constant",
          warmup_steps: int = 0, min_lr: float | None = None) -> float:
    """The learning rate used by step ``step`` (0-based) of a run of ``total_steps`` steps.

    With W = ``warmup_steps``, T = ``total_steps``, η = ``lr``, η_min = ``min_lr``
    (default 0.1 η):

    - warm-up, step s < W: η · (s + 1) / W — linear from 0 towards η, as nanoGPT and
      torchtitan warm up (Goyal et al. 2017, "Accurate, large minibatch SGD"). Step 0 uses
      η / W, not 0: a step at rate 0 would compute a gradient and throw it away; step W − 1
      reaches η.
    - then "constant": η;
    - then "cosine" (Loshchilov & Hutter 2017, SGDR, eq. 5 without restarts):
      η_min + ½ (η − η_min) (1 + cos(π · (s − W) / (T − W))), so step W uses η and the rate
      reaches η_min at s = T, one step after the last (the last step, T − 1, is just above
      η_min). Steps past T (a run extended beyond its schedule) stay at η_min.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"lr schedule must be one of {SCHEDULES}, got {schedule!r}")
    if step < 0 or warmup_steps < 0:
        raise ValueError(f"step and warmup_steps must be non-negative, got {step}, {warmup_steps}")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    floor = 0.1 * lr if min_lr is None else min_lr
    span = total_steps - warmup_steps
    progress = 1.0 if span <= 0 else min(1.0, (step - warmup_steps) / span)
    return floor + 0.5 * (lr - floor) * (1.0 + math.cos(math.pi * progress))
