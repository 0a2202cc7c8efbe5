"""Zero bubble's split backward: B computes input gradients only, W the weight GEMMs, no graph.

Chapter 7, notebooks/07_pipeline_parallel.ipynb (``run_action``'s B and W). Qi et al. 2024,
"Zero Bubble Pipeline Parallelism", section 2: a linear layer y = x Aᵀ + b has two backward
products, the input gradient ∂L/∂x = g A (B: the previous stage waits for it) and the weight
gradient ∂L/∂A = gᵀ x, ∂L/∂b = Σ g (W: nobody waits for it), g = ∂L/∂y. So:

- **F** runs the chunk under ``LinearCalls``, a ``TorchFunctionMode`` that records every
  ``F.linear`` whose weight is a *W parameter* (``w_parameters``): its input x, its output's
  gradient edge, and which weight and bias it used. ``nn.Linear``, tensor parallelism's
  ``ColumnParallelLinear`` and ``RowParallelLinear`` all call ``F.linear``, so the GEMM seen is
  the one that ran (after a sequence-parallel all-gather, before a row layer's reduce).
- **B** (``backward_input``): one ``torch.autograd.grad`` from the chunk's output into its input,
  the recorded outputs (their gradients g) and the other parameters (LayerNorms, embeddings,
  a row layer's bias added after the reduce — small, so B does them), *without* keeping the
  graph: autograd skips the weight GEMMs (no weight is asked for) and frees every saved
  activation except what W needs, the pairs (x, g), held in ``WeightWork``.
- **W** (``WeightWork.apply``): the GEMMs gᵀx (and Σg) added into ``.grad``. No autograd.

A W parameter is a GEMM's weight (or ``nn.Linear``'s / the column layer's bias) owned by no
other module: a weight tied to an embedding gets both its gradients in B. Any other use of a
W parameter in the forward raises (its gradient would be lost), and so does a W parameter with
a post-accumulate-grad hook (W writes ``.grad`` itself: the hook would never fire). W's pairs are held through
autograd's saved-tensor hooks (``_Hold``), so memory trackers (chapter 1's ``LiveSavedBytes``)
count them as what they are: activations kept for the rest of the backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.overrides import TorchFunctionMode

from minitrain.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

# the parameters each layer type passes to F.linear (the row layer adds its bias after the sum)
GEMM_PARAMETERS = {nn.Linear: ("weight", "bias"), ColumnParallelLinear: ("weight", "bias"),
                   RowParallelLinear: ("weight",)}


def w_parameters(modules) -> set:
    """The parameters whose gradient W computes: used by a layer's F.linear, owned by no
    other module (``modules``: what a chunk runs; shared submodules are visited once each)."""
    gemm, other = set(), set()
    for module in modules:
        for sub in module.modules():
            kinds = next((names for t, names in GEMM_PARAMETERS.items() if type(sub) is t), ())
            for name, q in sub.named_parameters(recurse=False):
                if q.requires_grad:
                    (gemm if name in kinds else other).add(q)
    return gemm - other


class LinearCalls(TorchFunctionMode):
    """Record each ``F.linear`` on a W parameter during a chunk's forward (see the module
    docstring); ``.calls``: (input, output's gradient edge, weight, bias or None)."""

    def __init__(self, params: set):
        super().__init__()
        if any(getattr(q, "_post_accumulate_grad_hooks", None) for q in params):
            # W writes .grad itself: a hook on autograd's accumulation (DDP buckets, ZeRO,
            # master weights) would never fire — refuse rather than train wrong
            raise ValueError("zero bubble's W cannot serve a parameter with a post-accumulate-"
                             "grad hook (DDP, ZeRO, master weights): run a schedule without W")
        self.ids = {id(q): q for q in params}
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ids = self.ids
        if func is F.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if id(weight) in ids:
                self.calls.append((x.detach(), get_gradient_edge(out), weight,
                                   bias if id(bias) in ids else None))
            return out
        # every other op: does it touch a W parameter? (cheap: ids only, one level of lists)
        for a in (*args, *kwargs.values()):
            hit = id(a) in ids or (type(a) in (list, tuple) and any(id(b) in ids for b in a))
            if hit and getattr(func, "__name__", "") != "__get__":  # attribute reads are fine
                raise RuntimeError(f"zero bubble's W: a linear layer's parameter is used by "
                                   f"{getattr(func, '__name__', func)}, not only by F.linear: "
                                   "its gradient would be lost; tie it to a non-linear module "
                                   "(then B computes it) or run a schedule without W")
        return out


class _Hold(torch.autograd.Function):
    """Keeps tensors through autograd's saved-tensor hooks (so trackers count them)."""

    @staticmethod
    def forward(ctx, anchor, *tensors):
        ctx.save_for_backward(*tensors)
        return anchor.detach().clone()

    @staticmethod
    def backward(ctx, grad):  # never called: the holder is dropped, not differentiated
        raise RuntimeError("_Hold is storage, not a differentiable step")


class WeightWork:
    """What W needs of one micro-batch through one chunk: per recorded GEMM, (x, g)."""

    def __init__(self, calls, grads, device):
        self.params = [(weight, bias) for _, _, weight, bias in calls]
        tensors = [t for (x, *_), g in zip(calls, grads) for t in (x, g)]
        self.present = [g is not None for g in grads]  # an output that got no gradient
        with torch.enable_grad():
            anchor = torch.zeros((), device=device, requires_grad=True)
            self.holder = _Hold.apply(anchor, *[t for t in tensors if t is not None])

    def apply(self) -> None:
        """W: ∂L/∂A += gᵀx and ∂L/∂b += Σg for every recorded GEMM, then drop the pairs."""
        held = iter(self.holder.grad_fn.saved_tensors)
        for (weight, bias), present in zip(self.params, self.present):
            x = next(held)
            if not present:
                continue
            g = next(held)
            g2 = g.reshape(-1, g.shape[-1])
            accumulate(weight, g2.t() @ x.reshape(-1, x.shape[-1]))
            if bias is not None:
                accumulate(bias, g2.sum(0))
        self.holder = None  # the pairs are freed (and un-counted) here


def accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """``param.grad += grad`` as autograd's AccumulateGrad does (set if None)."""
    if param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad.add_(grad)


def backward_input(out, grad, x, calls, params, need_input: bool) -> tuple:
    """B: one autograd pass from ``out`` (upstream ``grad``, None for the loss) into the input
    ``x`` (if ``need_input``), the recorded GEMM outputs and the non-W ``params`` (their
    gradients accumulated here); the graph is freed. Returns (x's gradient or None, the
    ``WeightWork`` for W)."""
    inputs = ([x] if need_input else []) + [edge for _, edge, _, _ in calls] + list(params)
    grads = torch.autograd.grad(out, inputs, grad, allow_unused=True) if inputs else []
    k = int(need_input)
    x_grad, gemm, rest = grads[0] if need_input else None, grads[k:k + len(calls)], grads[k + len(calls):]
    for q, g in zip(params, rest):
        if g is not None:
            accumulate(q, g)
    return x_grad, WeightWork(calls, gemm, out.device)
