"""Chapter 4 bug hunt — minitrain.ddp.data_parallel.DataParallel.no_sync (the fix, as the
library has it).

Gradient accumulation over DDP: micro-batches inside `no_sync()` should only add up local
gradients, and one all-reduce at the last micro-batch averages the sum. Training loops and
wrappers over DDP have shipped accumulation that synchronised on every micro-batch: the loss
curve is perfect, the job is just k times chattier.

What you see: Accumulating 4 micro-batches on 2 ranks gives exactly the right gradients, but
the timeline shows an all-reduce after every micro-batch, and 4x the bytes of one step.

Your tools: notebook 04's timeline (`launch(...).traces`,
`minitrain.runtime.trace.plot_timeline`): count the 'all-reduce bucket' spans per step;
chapter 4's formula for the bytes of one step.

One line of the function below is wrong or missing. Fix it in
my_exercises/bughunt04_accumulation.py (run `python -m minitrain.exercises start` once),
then `python -m minitrain.grade 4` re-runs the broken scenario.
"""

# ruff: noqa: F405 (the library module's names come from the star import)
from __future__ import annotations

from minitrain.ddp.data_parallel import *  # noqa: F403 — the module's names, as the library sees them


class DataParallel:
    # Only the method with the bug; the rest of the class is in minitrain.ddp.data_parallel.

    @contextmanager
    def no_sync(self):
        """Backward inside this block only accumulates local gradients (gradient accumulation);
        the next backward outside it averages the accumulated sum."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

# minitrain-exercises-hash: 17fe8cce919469aa
