"""The global gradient norm of a model spread over a mesh, clipping, and fp16's skip, agreed by all.

Chapter 11, notebooks/11_putting_it_together.ipynb; ``ParallelGPT`` (trainer.py) calls it
between backward and the optimizer step. Clipping scales every gradient by
min(1, max_norm / (‖g‖ + 1e-6)), ‖g‖ the norm of the *whole* model's gradient (Pascanu et al.
2013; ``torch.nn.utils.clip_grad_norm_``'s rule), so on a mesh ‖g‖² must count every
parameter element exactly once. Each rank holds some of them:

- tensor parallelism: a split weight's slices differ across the TP group (sum them), but a
  LayerNorm or a row-parallel bias is whole on every TP rank (count it on TP rank 0 only, not
  t times — Megatron-LM's ``param_is_not_tensor_parallel_duplicate``);
- pipeline stages hold different blocks (sum them);
- data / context parallel replicas hold the same averaged gradient (count rank 0's), while
  ZeRO/FSDP shards of it differ (sum them, as ``minitrain.fsdp.clip_grad_norm_`` does).

So every rank sums the squares of the elements it *owns*, and one all-reduce over the whole
mesh adds them up. With fp16, chapter 2's ``DynamicLossScaler`` first divides the gradients
by S (the norm is of the *unscaled* gradient) and the overflow verdict is all-reduced over
every rank of the mesh: TP ranks and pipeline stages hold different gradients too, and a
skip taken on some ranks only would let the replicas of the model drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


@dataclass
class OwnedGradients:
    """The fp32 tensors whose ``.grad`` the optimizer steps, and which of their elements this
    rank owns: ``True`` (all), ``False`` (none) or a bool mask of the tensor's shape."""

    params: list = field(default_factory=list)
    owned: list = field(default_factory=list)

    def add(self, param, owned) -> None:
        self.params.append(param)
        self.owned.append(owned)


def owns(local_numel: int, dense_numel: int, tp_rank: int, dp_rank: int,
         dp_sharded: bool) -> bool:
    """Does this rank count a parameter (or its slice)? A TP split (fewer elements than the
    dense parameter) is this rank's own; a TP-replicated one is TP rank 0's; a DP/CP replica
    is DP rank 0's unless ZeRO sharded it (then the slice is this rank's own)."""
    tp_ok = local_numel < dense_numel or tp_rank == 0
    dp_ok = dp_sharded or dp_rank == 0
    return tp_ok and dp_ok


def owned_parameters(named, dense_numels: dict, tp_group, dp_group, experts=(),
                     expert_dp_group=None) -> OwnedGradients:
    """``named``: (name, fp32 tensor whose ``.grad`` is stepped, local numel) triples of whole
    (not ZeRO-sharded) parameters, names as in the dense GPT. ``experts``: the names of
    expert-parallel experts (chapter 8): replicated over tp and over ``expert_dp_group`` (the
    ranks holding the same experts), different across the ep ranks — so TP rank 0 and
    expert-data-parallel rank 0 count them."""
    tp_rank, dp_rank = dist.get_rank(tp_group), dist.get_rank(dp_group)
    expert_rank = dist.get_rank(expert_dp_group) if experts else 0
    out = OwnedGradients()
    for name, param, numel in named:
        if name in experts:
            out.add(param, tp_rank == 0 and expert_rank == 0)
        else:
            out.add(param, owns(numel, dense_numels[name], tp_rank, dp_rank, dp_sharded=False))
    return out


def owned_zero_shards(units, dp_rank: int, dense_numels: dict, tp_group) -> OwnedGradients:
    """The fp32 master shards of ``ZeroDataParallel``'s flat units: a shard mixes TP-split and
    TP-replicated parameters, so ownership is a mask over its elements (padding: not owned)."""
    tp_rank = dist.get_rank(tp_group)
    out = OwnedGradients()
    for u in units:
        full = torch.zeros(u.padded, dtype=torch.bool, device=u.master.device)
        for k, name in enumerate(u.names):
            numel = u.offsets[k + 1] - u.offsets[k]
            if owns(numel, dense_numels[name], tp_rank, dp_rank, dp_sharded=True):
                u.slot(full, k).fill_(True)
        out.add(u.master, full[dp_rank * u.shard_numel:(dp_rank + 1) * u.shard_numel])
    return out


def global_grad_norm(grads: OwnedGradients, group: ProcessGroup | None = None) -> torch.Tensor:
    """‖g‖₂ of the whole model: this rank's owned squares, summed over ``group`` (the mesh).
    Squares accumulate in ``promote_types(dtype, fp32)`` (fp32, fp64 stays fp64)."""
    present = [(p.grad, o) for p, o in zip(grads.params, grads.owned) if p.grad is not None]
    ref = grads.params[0]
    acc = torch.float32
    for g, _ in present:
        acc = torch.promote_types(acc, g.dtype)
    square = torch.zeros((), dtype=acc, device=ref.device)
    for g, owned in present:
        if owned is True:
            square += g.to(acc).pow(2).sum()
        elif owned is not False:
            square += g.to(acc)[owned].pow(2).sum()  # indexing: an inf elsewhere stays out
    dist.all_reduce(square, group=group)
    return square.sqrt()


def clip_(grads: OwnedGradients, total: torch.Tensor, max_norm: float) -> None:
    """Scale every gradient this rank holds (owned or not: replicas must stay equal) by
    ``torch.nn.utils.clip_grad_norm_``'s coefficient min(1, max_norm / (total + 1e-6))."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in grads.params:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))


class GradientStep:
    """Between backward and the update: unscale (fp16), agree on overflow over the whole mesh,
    the global norm, clipping. ``metrics`` holds the step's ``grad_norm`` (before clipping; a
    0-dim device tensor, so the host waits once per step, when the trainer reads every number
    together) and, with a scaler, ``loss_scale`` (the S this step's backward used)."""

    def __init__(self, grads: OwnedGradients | None, max_norm: float = 0.0, scaler=None):
        self.grads, self.max_norm, self.scaler = grads, max_norm, scaler
        self.metrics: dict = {}

    def prepare(self, optimizer) -> bool:
        """Unscale ``optimizer``'s gradients, measure, clip; False: skip this step (overflow)."""
        self.metrics = {}
        overflow = False
        if self.scaler is not None:
            self.metrics["loss_scale"] = self.scaler.get_scale()
            self.scaler.unscale_(optimizer)  # first: the norm is of the gradient ÷ S
            # the whole mesh (group=None): every rank skips, or none does
            overflow = self.scaler.all_reduce_found_inf(optimizer, None)
        total = global_grad_norm(self.grads)
        self.metrics["grad_norm"] = total  # a device tensor: the trainer reads it with the rest
        if self.max_norm > 0 and not overflow:
            clip_(self.grads, total, self.max_norm)
        return not overflow

    def step(self, optimizer) -> None:
        """``prepare``, then the optimizer's step (skipped on overflow), then S's update."""
        self.prepare(optimizer)
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)  # skips if the (agreed) verdict is an overflow
        self.scaler.update()

    def pre_hook(self, optimizer, args, kwargs):
        """The same, as a ``register_step_pre_hook`` of an optimizer that some wrapper steps
        itself (``ZeroDataParallel.step()`` sets the shards' gradients and calls it): a skip
        empties the gradients, so the optimizer leaves every parameter (and its state) as is."""
        if not self.prepare(optimizer):
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
        if self.scaler is not None:
            self.scaler.update()
