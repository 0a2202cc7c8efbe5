"""What a pipeline step sends once, outside its schedule's actions: the loss from the last
stage to every other one, and the gradients averaged over data parallelism.

Chapter 7, notebooks/07_pipeline_parallel.ipynb; ``PipelineStage.train_step`` calls all three
(``minitrain.parallel``'s trainer uses ``average_gradients`` too).

The loss. Only the last stage computes it, yet ``train_step`` returns it on *every* stage (a
training loop logs it on any rank). ``post_loss_receive`` runs before the step's first action,
``share_loss`` after its last:

- the mean over the micro-batches is taken in the model's dtype promoted with fp32 (bf16/fp16
  up, fp64 stays) and sent as float64, so every stage posts the same receive whatever its
  dtype (a bf16 loss sent into an fp32 buffer read 2e-41 on the other stages; an fp64 one
  aborted gloo);
- on the CPU (gloo, which matches messages by tag) the other stages post the receive before
  the step, so the send leaves the moment the loss exists: a broadcast after the step made the
  first stage, last to finish, wait for the idle last stage to wake up and answer (GPipe,
  m = 4: 2-5 % of the step on a loaded 2-core machine, measured). NCCL pairs messages in
  posting order, ignoring tags: there the receive is posted after the step's last activation
  or gradient. One step's bytes per group are the same on CPU and GPU (docs/design.md).

The gradients: with data parallelism beside the pipeline, averaged once per step, after the
last micro-batch (``average_gradients``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minitrain.runtime import strict_p2p

LOSS_TAG = 1 << 21  # the last stage's loss, sent to the others (gloo)


def post_loss_receive(stage, device) -> tuple[torch.Tensor, object]:
    """Before ``stage``'s (a ``PipelineStage``) first action: the float64 buffer the loss will
    arrive in, on ``device``, and its receive if posted now (gloo, any stage but the last;
    else None)."""
    last = stage.num_stages - 1
    loss = torch.zeros((), dtype=torch.float64, device=device)
    # early only where a posted receive waits aside (gloo's CPU tensors): with NCCL's semantics
    # (a GPU, or the CPU under MINITRAIN_P2P=strict) it would block every message behind it
    early = (stage.num_stages > 1 and torch.device(device).type == "cpu"
             and not strict_p2p.installed())
    loss_recv = (dist.irecv(loss, stage.rank_of(last), stage.group, LOSS_TAG)
                 if early and stage.stage != last else None)
    return loss, loss_recv


def share_loss(stage, state, received: tuple, dtype: torch.dtype) -> torch.Tensor:
    """After ``stage``'s last action: the last stage takes the mean of ``state.losses`` and
    sends it to every other stage; every send of the step (``state.sends``) is waited for; the
    other stages receive the loss (``received``: what ``post_loss_receive`` returned; the
    receive is posted now where it was not). Returns the loss in ``dtype`` on every stage."""
    loss, loss_recv = received
    last = stage.num_stages - 1
    if stage.stage == last:
        loss = torch.stack(state.losses).to(dtype).mean().double()  # exact: fp32 or fp64
        for s in range(last):  # every stage returns the loss
            state.sends.append((dist.isend(loss, stage.rank_of(s), stage.group, LOSS_TAG), loss))
    for work, _ in state.sends:
        work.wait()
    if stage.stage != last and loss_recv is None:
        loss_recv = dist.irecv(loss, stage.rank_of(last), stage.group, LOSS_TAG)
    if loss_recv is not None:
        loss_recv.wait()
    return loss.to(dtype)


def average_gradients(params, group) -> None:
    """Average ``.grad`` over ``group`` with one all-reduce of one flat buffer: once per step,
    after the last micro-batch (per micro-batch would send m times the bytes)."""
    grads = [q.grad for q in params if q.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
