"""RMSNorm and LayerNorm as one hand-fused ``autograd.Function`` each (chapter 12,
notebooks/12_kernels_and_compilers.ipynb).

Unfused, ``x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight`` is five ops,
and autograd keeps what each needs for its backward: x, x², the mean, the reciprocal root,
the normalised x — several copies of the activation. Fused, the forward keeps only its
input and one number per row (the reciprocal RMS; LayerNorm also the mean), and the backward
recomputes the normalised x from them: the saved bytes fall to N·d·e + N·4 (plus the weight,
which is kept anyway). Chapter 12's exercise is ``RMSNormFunction.backward``. That is what a fused kernel does on a GPU as well — FlashAttention is
the same idea for attention (chapter 9) — and what ``torch.compile``'s partitioner decides
on its own (notebook 12, section 4).

Statistics (mean, reciprocal root) are computed and saved in fp32 for 16-bit inputs, as
torch's own kernels do, and in fp64 for fp64 inputs; outputs and gradients come back in the
input's dtype. ``backend="triton"`` runs the same two functions as Triton kernels
(``triton_norms.py``).

Zhang & Sennrich 2019 (RMSNorm); Ba et al. 2016 (LayerNorm).
"""

from __future__ import annotations

import math

import torch


def accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype chapter 12's kernels compute and keep statistics in: fp64 for fp64, else
    fp32 (a 16-bit sum over a row or a vocabulary loses what it is made of)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check(x: torch.Tensor, weight: torch.Tensor, name: str) -> None:
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"{name}: weight has shape {tuple(weight.shape)}, the last dimension "
                         f"of x is {x.shape[-1]}")
    if weight.device != x.device:
        raise ValueError(f"{name}: x is on {x.device}, weight on {weight.device}")


def _sum_to_last_dim(t: torch.Tensor) -> torch.Tensor:
    """Sum over every dimension but the last: a parameter's gradient over all rows."""
    return t.reshape(-1, t.shape[-1]).sum(0)


class RMSNormFunction(torch.autograd.Function):
    """y = x · r · w with r = 1/√(mean(x²) + ε) per row; saves x, w and r (one per row)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        stat = accumulation_dtype(x)
        xs = x.to(stat)
        rstd = torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xs * rstd * weight.to(stat)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        """The gradients of RMSNorm's inputs, from what ``forward`` saved.

        ``ctx.saved_tensors`` is ``(x, weight, rstd)``: the input x (any shape (..., d), any
        float dtype), the weight (d,) and the reciprocal root r = 1/√(mean(x²) + ε) of each
        row, shape (..., 1), in fp32 — fp64 when x is fp64. ``grad_out`` is the gradient of
        the output y = x · r · w, x's shape and dtype.

        Returns ``(grad_x, grad_weight, None)``: grad_x in x's shape and dtype, grad_weight
        (d,) in the weight's dtype (every row contributes to it), None for ``eps``. Compute
        in r's dtype, as the forward did (16-bit gradients summed over many rows in 16 bits
        lose what the sum is made of), and cast back at the end. Do not modify ``grad_out``
        (autograd may hand the same tensor to another function) and keep nothing new: the
        whole point is that forward saved only x and r, and backward rebuilds the rest.

        The grader compares with ``torch.nn.functional.rms_norm``'s gradients in fp64
        (within 1e-12), fp32 (1e-6) and bf16 (the dtypes you return), on 2-D and 3-D inputs,
        and checks ``grad_out`` is left as it was. Deriving the gradient of x is the exercise:
        r depends on every x of its row.
        """
        x, weight, rstd = ctx.saved_tensors
        ### BEGIN SOLUTION
        stat = rstd.dtype
        xs, g = x.to(stat), grad_out.to(stat)
        xhat = xs * rstd  # the normalised input, recomputed: one multiply, no saved copy
        gw = g * weight.to(stat)
        # d(x_j r)/dx_i = r δ_ij − r³ x_i x_j / d, so dx = r (gw − x̂ · mean(gw · x̂))
        dx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
        dweight = _sum_to_last_dim(g * xhat)
        return dx.to(x.dtype), dweight.to(weight.dtype), None
        ### END SOLUTION


class LayerNormFunction(torch.autograd.Function):
    """y = (x − μ) · r · w + b with μ the row mean and r = 1/√(var + ε) (biased variance);
    saves x, w, μ and r (one each per row)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        stat = accumulation_dtype(x)
        xs = x.to(stat)
        mean = xs.mean(-1, keepdim=True)
        rstd = torch.rsqrt((xs - mean).pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        return ((xs - mean) * rstd * weight.to(stat) + bias.to(stat)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, mean, rstd = ctx.saved_tensors
        stat = rstd.dtype
        g = grad_out.to(stat)
        xhat = (x.to(stat) - mean) * rstd
        gw = g * weight.to(stat)
        # the mean and the variance both depend on every x of the row: two row means remove
        # the parts of gw that move all of x̂ together and that scale it
        dx = rstd * (gw - gw.mean(-1, keepdim=True) - xhat * (gw * xhat).mean(-1, keepdim=True))
        dweight, dbias = _sum_to_last_dim(g * xhat), _sum_to_last_dim(g)
        return dx.to(x.dtype), dweight.to(weight.dtype), dbias.to(weight.dtype), None


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                   backend: str = "torch") -> torch.Tensor:
    """RMSNorm over the last dimension, as ``torch.nn.functional.rms_norm(x, (d,), weight,
    eps)``; differentiable in ``x`` and ``weight``. ``backend``: "torch" (``RMSNormFunction``)
    or "triton" (the Triton kernels: fp32/fp16/bf16 only)."""
    _check(x, weight, "fused_rms_norm")
    if backend == "triton":
        from minitrain.kernels.triton_norms import triton_rms_norm

        return triton_rms_norm(x, weight, eps)
    if backend != "torch":
        raise ValueError(f"fused_rms_norm: backend {backend!r}; use 'torch' or 'triton'")
    return RMSNormFunction.apply(x, weight, eps)


def fused_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                     eps: float = 1e-5, backend: str = "torch") -> torch.Tensor:
    """LayerNorm over the last dimension, as ``torch.nn.functional.layer_norm(x, (d,),
    weight, bias, eps)``; differentiable in ``x``, ``weight`` and ``bias``. ``backend`` as
    for ``fused_rms_norm``."""
    _check(x, weight, "fused_layer_norm")
    _check(x, bias, "fused_layer_norm")
    if backend == "triton":
        from minitrain.kernels.triton_norms import triton_layer_norm

        return triton_layer_norm(x, weight, bias, eps)
    if backend != "torch":
        raise ValueError(f"fused_layer_norm: backend {backend!r}; use 'torch' or 'triton'")
    return LayerNormFunction.apply(x, weight, bias, eps)


def norm_saved_bytes(shape, dtype: torch.dtype, kind: str = "rms") -> int:
    """What the fused norm keeps for backward besides its weight, in bytes: the input
    (N·d·e) and one fp32 (fp64 for fp64 input) statistic per row — RMSNorm the reciprocal
    root, LayerNorm also the mean. ``shape`` is the input's; N the product of all but the last."""
    d, rows = shape[-1], math.prod(shape[:-1])
    stat = 8 if dtype == torch.float64 else 4
    per_row = {"rms": 1, "layer": 2}[kind]
    return rows * d * dtype.itemsize + rows * per_row * stat
