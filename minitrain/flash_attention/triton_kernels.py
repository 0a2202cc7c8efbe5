"""FlashAttention-2 as Triton kernels: the tiles of ``tiles.py``, one GPU program per block.

What it teaches (notebook 09_flash_attention): what "a tile in SRAM" means on a GPU — a
Triton program loads a block of Q (or K, V) into registers/shared memory, loops over the
other operand's blocks, and writes its result block once. Dao 2023, Algorithm 1 (forward)
and Algorithm 2 (backward), section 3.2 for the parallelisation over query blocks.

The mode is chosen per call from the tensors' device (``kernels_for``, through
``minitrain.runtime.triton_modes``): CPU tensors run under Triton's interpreter (numpy on the
CPU: correctness only), CUDA tensors run compiled kernels.

Precision: on GPUs ``tl.dot`` with fp32 inputs defaults to TF32 (10-bit mantissa), which
differs from fp32 by ~1e-3 relative; comparisons of fp32 results at fp32 tolerance need
``input_precision="ieee"``, which these kernels use for fp32 inputs (bf16/fp16 inputs are
exact products accumulated in fp32 either way).

Backward: dK, dV by key block (one program per key block and query head loops over the
query blocks, accumulating dK_j, dV_j in registers and writing them once), and dQ by query
block in a second kernel (one program per query block loops over key blocks). The
alternative — dQ with atomic adds from the key-block programs (Dao 2023, Alg. 2 line 15) —
recomputes the scores once instead of twice, but atomic fp32 adds land in a run-dependent
order, so dQ is not bit-reproducible; we pay one more Q K^T per tile for determinism (and
a kernel simple to read). GQA: each query head's program writes its own dK, dV slice, summed
over the group in PyTorch afterwards — no atomics there either.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from minitrain.runtime.triton_modes import check_device, kernels_for_device

# Only Triton *builtins* and our own jitted functions are called inside the kernels, not
# triton.language's jitted helpers (tl.zeros, tl.max, tl.sum): those were decorated when Triton
# was first imported, in whatever mode was set then, and a compiled-mode helper cannot run
# inside an interpreted kernel (nor the other way round).


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def row_max(x):
    return tl.reduce(x, 1, _larger)


@triton.jit
def row_sum_of(x):
    return tl.reduce(x, 1, _add)


@triton.jit
def flash_forward_kernel(Q, K, V, Out, L, n_q, n_k, groups, scale,
                D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
                BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    # program (query block, batch*query head); every tensor contiguous (rows of D elements)
    pid_q, pid_h = tl.program_id(0), tl.program_id(1)
    q_base = pid_h.to(tl.int64) * n_q * D
    kv_base = (pid_h // groups).to(tl.int64) * n_k * D  # the k/v head this query head uses
    rows = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    cols = tl.arange(0, BLOCK_D)
    row_ok, col_ok = rows < n_q, cols < D
    q = tl.load(Q + q_base + rows[:, None] * D + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    m = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    row_sum = tl.full([BLOCK_Q], 0.0, tl.float32)
    acc = tl.full([BLOCK_Q, BLOCK_D], 0.0, tl.float32)
    hi = n_k
    if CAUSAL:  # key blocks after this block's last query are fully masked: never visited
        hi = tl.minimum(n_k, (pid_q + 1) * BLOCK_Q)
    for start in range(0, hi, BLOCK_K):
        keys = start + tl.arange(0, BLOCK_K)
        kv_mask = (keys < n_k)[:, None] & col_ok[None, :]
        k = tl.load(K + kv_base + keys[:, None] * D + cols[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + kv_base + keys[:, None] * D + cols[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = (keys < n_k)[None, :]
        if CAUSAL:
            visible = visible & (keys[None, :] <= rows[:, None])
        s = tl.where(visible, s, float("-inf"))
        # online softmax (Dao 2023, Alg. 1 lines 8-10): rescale what was summed under the old max
        m_new = tl.maximum(m, row_max(s))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        row_sum = alpha * row_sum + row_sum_of(p)
        acc = alpha[:, None] * acc + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / row_sum[:, None]
    tl.store(Out + q_base + rows[:, None] * D + cols[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])
    tl.store(L + pid_h.to(tl.int64) * n_q + rows, m + tl.log(row_sum), mask=row_ok)


@triton.jit
def recompute_tile(q, k, v, do, lse, delta, rows, keys, n_q, n_k, scale,
                   CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """P = exp(S - L) rebuilt from the saved logsumexp (recomputation), and
    dS = P * (dO V^T - D) for one tile (Dao 2023, Alg. 2 lines 11-14); both backward kernels."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    visible = (rows < n_q)[:, None] & (keys < n_k)[None, :]
    if CAUSAL:
        visible = visible & (keys[None, :] <= rows[:, None])
    p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)  # P rebuilt from L: recomputation
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    return p, p * (dp - delta[:, None])


@triton.jit
def flash_backward_dkdv_kernel(Q, K, V, DO, L, DELTA, DK, DV, n_q, n_k, groups, scale,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
                     BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    # program (key block, batch*query head): dK_j, dV_j stay in registers over all query blocks
    pid_k, pid_h = tl.program_id(0), tl.program_id(1)
    q_base = pid_h.to(tl.int64) * n_q * D
    kv_base = (pid_h // groups).to(tl.int64) * n_k * D
    keys = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.arange(0, BLOCK_D)
    kv_mask = (keys < n_k)[:, None] & (cols < D)[None, :]
    k = tl.load(K + kv_base + keys[:, None] * D + cols[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + kv_base + keys[:, None] * D + cols[None, :], mask=kv_mask, other=0.0)
    dk = tl.full([BLOCK_K, BLOCK_D], 0.0, tl.float32)
    dv = tl.full([BLOCK_K, BLOCK_D], 0.0, tl.float32)
    lo = 0
    if CAUSAL:  # query blocks ending before this key block see none of it
        lo = (pid_k * BLOCK_K // BLOCK_Q) * BLOCK_Q
    for start in range(lo, n_q, BLOCK_Q):
        rows = start + tl.arange(0, BLOCK_Q)
        q_mask = (rows < n_q)[:, None] & (cols < D)[None, :]
        q = tl.load(Q + q_base + rows[:, None] * D + cols[None, :], mask=q_mask, other=0.0)
        do = tl.load(DO + q_base + rows[:, None] * D + cols[None, :], mask=q_mask, other=0.0)
        lse = tl.load(L + pid_h.to(tl.int64) * n_q + rows, mask=rows < n_q, other=0.0)
        delta = tl.load(DELTA + pid_h.to(tl.int64) * n_q + rows, mask=rows < n_q, other=0.0)
        p, ds = recompute_tile(q, k, v, do, lse, delta, rows, keys, n_q, n_k, scale, CAUSAL, PRECISION)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION) * scale
    # per query head (fp32): a GQA group's heads are summed by the caller
    out = pid_h.to(tl.int64) * n_k * D + keys[:, None] * D + cols[None, :]
    tl.store(DK + out, dk, mask=kv_mask)
    tl.store(DV + out, dv, mask=kv_mask)


@triton.jit
def flash_backward_dq_kernel(Q, K, V, DO, L, DELTA, DQ, n_q, n_k, groups, scale,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
                   BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    # program (query block, batch*query head): dQ_i stays in registers over the key blocks
    pid_q, pid_h = tl.program_id(0), tl.program_id(1)
    q_base = pid_h.to(tl.int64) * n_q * D
    kv_base = (pid_h // groups).to(tl.int64) * n_k * D
    rows = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    cols = tl.arange(0, BLOCK_D)
    q_mask = (rows < n_q)[:, None] & (cols < D)[None, :]
    q = tl.load(Q + q_base + rows[:, None] * D + cols[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + q_base + rows[:, None] * D + cols[None, :], mask=q_mask, other=0.0)
    lse = tl.load(L + pid_h.to(tl.int64) * n_q + rows, mask=rows < n_q, other=0.0)
    delta = tl.load(DELTA + pid_h.to(tl.int64) * n_q + rows, mask=rows < n_q, other=0.0)
    dq = tl.full([BLOCK_Q, BLOCK_D], 0.0, tl.float32)
    hi = n_k
    if CAUSAL:
        hi = tl.minimum(n_k, (pid_q + 1) * BLOCK_Q)
    for start in range(0, hi, BLOCK_K):
        keys = start + tl.arange(0, BLOCK_K)
        kv_mask = (keys < n_k)[:, None] & (cols < D)[None, :]
        k = tl.load(K + kv_base + keys[:, None] * D + cols[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + kv_base + keys[:, None] * D + cols[None, :], mask=kv_mask, other=0.0)
        _, ds = recompute_tile(q, k, v, do, lse, delta, rows, keys, n_q, n_k, scale, CAUSAL, PRECISION)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION) * scale
    tl.store(DQ + q_base + rows[:, None] * D + cols[None, :], dq, mask=q_mask)


def _as_heads(q, k, v):
    """(..., N, D) -> contiguous (Z*Hq, N, D) and (Z*Hkv, N, D) views, plus the group size."""
    if q.shape[:-2] == k.shape[:-2]:
        groups = 1
    elif q.dim() >= 3 and q.shape[:-3] == k.shape[:-3] and q.shape[-3] % k.shape[-3] == 0:
        groups = q.shape[-3] // k.shape[-3]
    else:
        raise ValueError(f"FlashAttentionTritonFunction needs equal leading dims or GQA heads; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    flat = [t.reshape(-1, *t.shape[-2:]).contiguous() for t in (q, k, v)]
    return *flat, groups


def _launch_args(q, k, groups, causal):
    d = q.shape[-1]
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # see the module docstring
    return dict(D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_Q=BLOCK, BLOCK_K=BLOCK,
                CAUSAL=bool(causal), PRECISION=precision), (q.shape[-2], k.shape[-2], groups,
                                                             1.0 / math.sqrt(d))


def _check_device(*tensors) -> torch.device:
    return check_device("FlashAttentionTritonFunction (q, k, v)", *tensors)


def kernels_for(device: torch.device):
    """This file's kernels decorated for ``device``: interpreted for the CPU, compiled for
    CUDA (``minitrain.runtime.triton_modes``: a module of their own per mode, loaded once)."""
    return kernels_for_device(__name__, __file__, device)


BLOCK = 32  # rows per tile; small so the interpreter stays quick (a GPU would use 64-128)


class FlashAttentionTritonFunction(torch.autograd.Function):
    """The contract of ``FlashAttentionFunction`` (``.apply(q, k, v, causal)``, saves q, k, v,
    out and the logsumexp (..., N)), computed by the Triton kernels above."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False):
        if torch.float64 in (q.dtype, k.dtype, v.dtype):  # refused, not silently rounded
            raise TypeError("FlashAttentionTritonFunction accumulates in fp32 registers, so "
                            "float64 inputs would get fp32 accuracy; use FlashAttentionFunction "
                            "(the PyTorch tiles accumulate fp64 inputs in fp64)")
        kernels = kernels_for(_check_device(q, k, v))
        qf, kf, vf, groups = _as_heads(q, k, v)
        out = torch.empty_like(qf)
        lse = torch.empty(qf.shape[:-1], dtype=torch.float32, device=q.device)
        meta, args = _launch_args(qf, kf, groups, causal)
        grid = (triton.cdiv(qf.shape[-2], BLOCK), qf.shape[0])
        kernels.flash_forward_kernel[grid](qf, kf, vf, out, lse, *args, **meta)
        out, lse = out.reshape(q.shape), lse.reshape(q.shape[:-1])
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal = bool(causal)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        qf, kf, vf, groups = _as_heads(q, k, v)
        do = grad_out.reshape(qf.shape).contiguous()
        # D_i = rowsum(dO_i * O_i): one elementwise pass, O(N d), done in PyTorch
        delta = (do.float() * out.reshape(qf.shape).float()).sum(-1).contiguous()
        lse_f = lse.reshape(qf.shape[:-1]).contiguous()
        meta, args = _launch_args(qf, kf, groups, ctx.causal)
        n_q, n_k, z_h = qf.shape[-2], kf.shape[-2], qf.shape[0]
        dk = torch.empty(z_h, n_k, qf.shape[-1], dtype=torch.float32, device=q.device)
        dv = torch.empty_like(dk)
        dq = torch.empty(qf.shape, dtype=torch.float32, device=q.device)
        kernels = kernels_for(q.device)
        kernels.flash_backward_dkdv_kernel[(triton.cdiv(n_k, BLOCK), z_h)](
            qf, kf, vf, do, lse_f, delta, dk, dv, *args, **meta)
        kernels.flash_backward_dq_kernel[(triton.cdiv(n_q, BLOCK), z_h)](
            qf, kf, vf, do, lse_f, delta, dq, *args, **meta)
        # a k/v head's gradient is the sum over its group of query heads (consecutive heads)
        dk = dk.reshape(-1, groups, n_k, qf.shape[-1]).sum(1).reshape(k.shape).to(k.dtype)
        dv = dv.reshape(-1, groups, n_k, qf.shape[-1]).sum(1).reshape(v.shape).to(v.dtype)
        return dq.reshape(q.shape).to(q.dtype), dk, dv, None
