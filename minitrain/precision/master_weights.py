"""Master weights: an fp32 copy of fp16/bf16 weights, so small updates are not lost.

Chapter 2, notebooks/02_floating_point_and_loss_scaling.ipynb. An update smaller than half an
ulp of a bf16 weight rounds away; keeping the weights (and the optimizer) in fp32 and copying
them, rounded, into the low-precision model after each step keeps those digits (Micikevicius
et al. 2018, "Mixed Precision Training", section 3.1).

Under data parallelism the masters must step on the gradient *averaged over ranks*. Autograd's
per-parameter hook fires before DDP's all-reduce has averaged anything, so when the model is a
``minitrain.ddp.DataParallel`` the masters take each gradient from DDP's own "averaged" hook
instead (Li et al. 2020, "PyTorch Distributed", §3.2: the average is only known after the
bucket's all-reduce).
"""

from __future__ import annotations

import torch
from torch import nn


def _accumulate_into_master(master: torch.Tensor, grad: torch.Tensor) -> None:
    # Called once a gradient is complete (alone: by autograd; under DataParallel: once the
    # average is written): add it into an fp32 buffer, so gradient accumulation over
    # micro-batches happens in fp32.
    grad = grad.to(torch.float32)
    master.grad = grad if master.grad is None else master.grad.add_(grad)


class MasterWeightOptimizer:
    """Mixed precision by hand: fp16/bf16 model, fp32 master weights and optimizer state.

    Forward and backward run in the model's precision; each gradient is moved into an fp32
    `.grad` on its master copy as soon as it is final; `step()` updates the masters in fp32
    with `optimizer_cls(masters, **kw)` and copies them back, rounded, to the model.
    `param_groups` are the masters', so `DynamicLossScaler` (or torch's GradScaler) unscales
    fp32 gradients.

    When is a gradient final? On one process, when autograd has accumulated it
    (`register_post_accumulate_grad_hook`). When `model` is a `minitrain.ddp.DataParallel`
    (wrap first, then build this optimizer on the wrapper), only once DDP has averaged it
    over ranks: the move then hangs on DDP's `register_averaged_grad_hook`, so every rank's
    masters step on the same, averaged gradient. Each synchronised backward is added to the
    masters in fp32; backwards under `no_sync()` accumulate locally in the model's dtype
    first (DDP sums them in `.grad`, as torch's DDP does) and reach the masters at the next
    synchronised backward.
    """

    def __init__(self, model: nn.Module, optimizer_cls, **kw):
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        if not self.model_params:
            raise ValueError(f"{type(model).__name__} has no trainable parameters")
        self.master_params = [
            p.detach().to(torch.float32).clone().requires_grad_(True) for p in self.model_params
        ]
        self.optimizer = optimizer_cls(self.master_params, **kw)
        self._master_of = dict(zip(self.model_params, self.master_params))  # hash by id

        def move(param):  # the low-precision grad is freed once in the master
            self.add_gradient(param, param.grad)
            param.grad = None

        # duck-typed, so chapter 2 needs nothing from chapter 4: a DataParallel offers the hook
        averaged_hook = getattr(model, "register_averaged_grad_hook", None)
        if averaged_hook is not None:
            averaged_hook(move)  # after the all-reduce: the average
        else:
            for p in self.model_params:
                p.register_post_accumulate_grad_hook(move)  # alone: this gradient is final

    def add_gradient(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Add ``grad`` (any dtype; fp32 keeps every digit) into ``param``'s master gradient:
        for a gradient finished outside the model's hooks, such as chapter 8's expert
        parameters averaged over their own group (``minitrain.parallel``'s
        ``ExpertGradients``), which the data-parallel wrapper leaves alone."""
        _accumulate_into_master(self._master_of[param], grad)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        for p, m in zip(self.model_params, self.master_params):
            p.grad, m.grad = None, None

    def step(self) -> None:
        """One optimizer step on the fp32 masters; the model's parameters follow.

        On entry each master's `.grad` holds its fp32 gradient. `self.optimizer` was built over
        `self.master_params` (fp32 copies; it never sees the model's parameters);
        `self.model_params[i]` is the model parameter of `self.master_params[i]`. Afterwards
        each master is the optimizer's update of itself, and each model parameter holds its
        master rounded to the parameter's dtype, to nearest even (what `copy_` into a bf16 or
        fp16 tensor does) — so an update smaller than the low-precision spacing is kept in the
        master and reaches the model once the sum is large enough. Writing into a parameter
        that requires grad must happen outside autograd.
        """
        ### BEGIN SOLUTION
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.model_params, self.master_params):
                p.copy_(m)
        ### END SOLUTION
