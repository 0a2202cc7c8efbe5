"""Held-out loss on any layout, and the learning rate of any layout's optimizer.

Chapter 11, notebooks/11_putting_it_together.ipynb; ``ParallelGPT.evaluate`` and
``ParallelGPT.set_lr`` (``trainer.py``) call these, ``python -m minitrain.train --eval-every``
and ``--lr-schedule`` use them.

Evaluation is a forward without a step: the model in eval mode (no dropout, Srivastava et
al. 2014 scale at test time by not dropping), under ``torch.no_grad()`` (no graph, so ZeRO-3
frees every unit after its forward and registers no backward hook), and the random state
saved and restored around it, so training continues bit-exactly as if no evaluation had run.
A pipeline evaluates with a forward-only schedule (one micro-batch through every virtual
stage, chapter 7's ``PipelineStage.run``: its messages posted as training's are) and the last
stage's loss is broadcast back.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from minitrain.checkpointing import get_rng_state, set_rng_state
from minitrain.pipeline import PipelineStage, StepState
from minitrain.tensor_parallel.random import load_rng_state_dict, rng_state_dict


def set_optimizer_lr(optimizer, lr: float) -> None:
    """Set ``lr`` in every parameter group of ``optimizer`` and of the optimizer it wraps:
    a torch optimizer; chapter 5's ``ShardedOptimizer`` (which copies its groups' rates into
    its local optimizer at each step); ``ZeroDataParallel`` (its ``.optimizer`` over the fp32
    shards); a master-weight optimizer (its ``.optimizer`` over the fp32 masters)."""
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        for group in getattr(optimizer, "param_groups", ()):
            group["lr"] = lr
        optimizer = getattr(optimizer, "optimizer", None)


def pipeline_forward_loss(stage: PipelineStage, x: torch.Tensor, y: torch.Tensor,
                          positions=None) -> torch.Tensor:
    """The mean loss of (x, y) through every stage, forward only, as one micro-batch; a float64
    0-dim tensor on every stage: the forward half of GPipe, for one micro-batch."""
    state = StepState([x], [y], 1, split_backward=False, positions=positions)
    state.key = ("eval", tuple(x.shape[1:]), x.shape[0])  # its own shape headers
    ref = next(stage.parameters())
    state.device = ref.device
    forwards = [("F", 0, c) if stage.num_chunks > 1 else ("F", 0) for c in range(stage.num_chunks)]
    stage.run([forwards] * stage.num_stages, state, complete=False)
    for work, _ in state.sends:
        work.wait()
    loss = torch.zeros((), dtype=torch.float64, device=ref.device)
    last = stage.num_stages - 1
    if stage.stage == last:
        loss = state.losses[0].double()
    if stage.num_stages > 1:
        src = last if stage.group is None else dist.get_global_rank(stage.group, last)
        dist.broadcast(loss, src, stage.group)
    return loss


@contextmanager
def evaluation_mode(modules: list, model):
    """Inside: every module in eval mode (dropout off: the held-out loss is the model's, not a
    noisy sample of it). On leaving: the modes as they were, and the global and per-rank
    (``model``'s TP dropout streams) random states as they were — nothing should have drawn
    from them; if anything did, it is undone, and training continues bit-exactly."""
    modes = [m.training for m in modules]
    devices = sorted({p.device for p in model.parameters() if p.device.type != "cpu"}, key=str)
    generators, streams = get_rng_state(devices), rng_state_dict(model)
    for m in modules:
        m.eval()
    try:
        yield
    finally:
        for m, mode in zip(modules, modes):
            m.train(mode)
        set_rng_state(generators)
        load_rng_state_dict(model, streams)


def held_out_loss(job, batches: int) -> float:
    """The mean loss of ``job`` (a ``ParallelGPT``) over held-out batches 0 … batches − 1 of
    its data, each the global batch averaged over DP × CP: the same number on every layout."""
    modules = [m for m in (job.model, job.wrapped, job.stage) if m is not None]
    total = 0.0
    with evaluation_mode(modules, job.model), torch.no_grad():
        for i in range(batches):
            x, y = job.local_batch(i, held_out=True)
            pos = None if job.context is None else job.context.positions(x)
            if job.stage is not None:
                loss = pipeline_forward_loss(job.stage, x, y, pos)
            else:
                loss = job.loss_fn(job.wrapped(x, positions=pos), y)
            total += job.reduce_loss(loss.double())
    # fp16: the loss functions multiply by the loss scale S (a power of two: exact to undo)
    scale = 1.0 if getattr(job, "scaler", None) is None else job.scaler.get_scale()
    return total / batches / scale
