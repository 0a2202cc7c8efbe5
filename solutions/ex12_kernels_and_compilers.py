"""Chapter 12 solutions — generated from minitrain.kernels.norms.

The worked answers. Look one up when you are stuck; the library has them too.
"""

from __future__ import annotations

import math
import torch
from minitrain.kernels.norms import _sum_to_last_dim


class RMSNormFunction:
    # Only the methods you write; the rest of the class is in minitrain.kernels.norms.

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

# minitrain-exercises-hash: f376cfc1d7802db8
