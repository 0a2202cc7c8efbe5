"""RMSNorm and LayerNorm as Triton kernels, forward and backward (chapter 12,
notebooks/12_kernels_and_compilers.ipynb): ``norms.py``'s two Functions, one GPU program
per block of rows.

What it teaches: a fused kernel reads each input once and writes each output once — the
row's statistics live in registers between the reduction and the scaling, where the unfused
ops write and re-read whole tensors. Each program takes ``ROWS`` rows of ``BLOCK_D`` columns
(the row length rounded up to a power of two, masked beyond it). The weight's gradient sums
over every row: each program writes the sum over its own rows, and PyTorch adds the
programs' partial sums — no atomics, so the result is the same on every run.

Modes (``minitrain.runtime.triton_modes``): CPU tensors run under Triton's interpreter
(correctness only), CUDA tensors compiled. fp64 is refused: the kernels accumulate in fp32
registers. Same contract as ``norms.py``: saves x, the weight and one fp32 statistic per row
(LayerNorm: two).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minitrain.runtime.triton_modes import check_device, kernels_for_device

ROWS = 16  # rows per program: small, so the interpreter stays quick (a GPU would take more)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _row_block(pid, n_rows, d, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program ``pid``'s rows and the row's columns (padded to BLOCK_D), which of them exist,
    and the offsets of the (ROWS, BLOCK_D) block in a row-major (n_rows, d) tensor."""
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_ok, col_ok = rows < n_rows, cols < d
    mask = row_ok[:, None] & col_ok[None, :]
    return rows, cols, row_ok, col_ok, mask, rows.to(tl.int64)[:, None] * d + cols[None, :]


@triton.jit
def rms_forward_kernel(X, W, Y, RSTD, n_rows, d, eps, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    rows, cols, row_ok, col_ok, mask, offs = _row_block(pid, n_rows, d, ROWS, BLOCK_D)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.reduce(x * x, 1, _add) / d + eps)
    tl.store(Y + offs, (x * rstd[:, None] * w[None, :]).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def rms_backward_kernel(X, W, G, RSTD, DX, DW, n_rows, d,
                        ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    rows, cols, row_ok, col_ok, mask, offs = _row_block(pid, n_rows, d, ROWS, BLOCK_D)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
    xhat = x * rstd[:, None]
    gw = g * w[None, :]
    dot = tl.reduce(gw * xhat, 1, _add) / d
    dx = rstd[:, None] * (gw - xhat * dot[:, None])
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW + pid * d + cols, tl.reduce(g * xhat, 0, _add), mask=col_ok)


@triton.jit
def layer_forward_kernel(X, W, B, Y, MEAN, RSTD, n_rows, d, eps,
                         ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    rows, cols, row_ok, col_ok, mask, offs = _row_block(pid, n_rows, d, ROWS, BLOCK_D)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    mean = tl.reduce(x, 1, _add) / d
    centred = tl.where(mask, x - mean[:, None], 0.0)  # the padding columns stay out of var
    rstd = 1.0 / tl.sqrt(tl.reduce(centred * centred, 1, _add) / d + eps)
    y = centred * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=row_ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def layer_backward_kernel(X, W, G, MEAN, RSTD, DX, DW, DB, n_rows, d,
                          ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    rows, cols, row_ok, col_ok, mask, offs = _row_block(pid, n_rows, d, ROWS, BLOCK_D)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
    rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
    xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    gw = g * w[None, :]
    mean_gw = tl.reduce(gw, 1, _add) / d
    dot = tl.reduce(gw * xhat, 1, _add) / d
    dx = rstd[:, None] * (gw - mean_gw[:, None] - xhat * dot[:, None])
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW + pid * d + cols, tl.reduce(g * xhat, 0, _add), mask=col_ok)
    tl.store(DB + pid * d + cols, tl.reduce(g, 0, _add), mask=col_ok)


def _prepare(name: str, x: torch.Tensor, *params):
    if torch.float64 in (x.dtype, *(p.dtype for p in params)):  # refused, not rounded
        raise TypeError(f"{name}: the Triton kernels accumulate in fp32 registers, so float64 "
                        "inputs would get fp32 accuracy; use backend='torch'")
    kernels = kernels_for_device(__name__, __file__, check_device(name, x, *params))
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    meta = dict(ROWS=ROWS, BLOCK_D=triton.next_power_of_2(x.shape[-1]))
    return kernels, rows, (triton.cdiv(rows.shape[0], ROWS),), meta


def _stats(rows: torch.Tensor) -> torch.Tensor:
    return torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)


def _partials(grid, rows: torch.Tensor) -> torch.Tensor:
    return torch.empty(grid[0], rows.shape[1], dtype=torch.float32, device=rows.device)


class RMSNormTritonFunction(torch.autograd.Function):
    """``norms.RMSNormFunction``'s contract, computed by the kernels above."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        kernels, rows, grid, meta = _prepare("fused_rms_norm(backend='triton')", x, weight)
        y, rstd = torch.empty_like(rows), _stats(rows)
        kernels.rms_forward_kernel[grid](rows, weight, y, rstd, rows.shape[0], rows.shape[1],
                                         eps, **meta)
        ctx.save_for_backward(x, weight, rstd)
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, rstd = ctx.saved_tensors
        kernels, rows, grid, meta = _prepare("fused_rms_norm(backend='triton')", x, weight)
        g = grad_out.reshape(rows.shape).contiguous()
        dx, dw = torch.empty_like(rows), _partials(grid, rows)
        kernels.rms_backward_kernel[grid](rows, weight, g, rstd, dx, dw, rows.shape[0],
                                          rows.shape[1], **meta)
        return dx.reshape(x.shape), dw.sum(0).to(weight.dtype), None


class LayerNormTritonFunction(torch.autograd.Function):
    """``norms.LayerNormFunction``'s contract, computed by the kernels above."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        kernels, rows, grid, meta = _prepare("fused_layer_norm(backend='triton')", x, weight,
                                             bias)
        y, mean, rstd = torch.empty_like(rows), _stats(rows), _stats(rows)
        kernels.layer_forward_kernel[grid](rows, weight, bias, y, mean, rstd, rows.shape[0],
                                           rows.shape[1], eps, **meta)
        ctx.save_for_backward(x, weight, mean, rstd)
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, mean, rstd = ctx.saved_tensors
        kernels, rows, grid, meta = _prepare("fused_layer_norm(backend='triton')", x, weight)
        g = grad_out.reshape(rows.shape).contiguous()
        dx, dw, db = torch.empty_like(rows), _partials(grid, rows), _partials(grid, rows)
        kernels.layer_backward_kernel[grid](rows, weight, g, mean, rstd, dx, dw, db,
                                            rows.shape[0], rows.shape[1], **meta)
        return (dx.reshape(x.shape), dw.sum(0).to(weight.dtype), db.sum(0).to(weight.dtype),
                None)


def triton_rms_norm(x, weight, eps):
    return RMSNormTritonFunction.apply(x, weight, eps)


def triton_layer_norm(x, weight, bias, eps):
    return LayerNormTritonFunction.apply(x, weight, bias, eps)
