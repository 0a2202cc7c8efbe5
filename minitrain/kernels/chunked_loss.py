"""A loss that never builds the logits: linear + cross-entropy, chunked over tokens (chapter
12, notebooks/12_kernels_and_compilers.ipynb).

``F.cross_entropy(x @ W.T, y)`` on T tokens and a vocabulary of V materialises the T×V
logits, and autograd keeps a T×V log-softmax for backward — for a 128K vocabulary and 8K
tokens, 4 GB each in fp32, more than the rest of a block's activations. The loss only needs,
per token, the log-sum-exp of its row and its target's logit, so the forward can walk the
tokens in chunks of C rows: build C×V logits, keep two numbers per token, drop the chunk.
The backward walks the chunks again, rebuilds each chunk's logits (one more matmul, the price
of the memory) and turns them into softmax − one-hot, whose products with W and x are the
input's and the weight's gradients. Peak: one chunk's C×V logits (and their gradient), not
T×V (Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models", which fuses
this into one kernel; Liger Kernel's fused linear cross-entropy computes the gradients during
the forward instead, keeping none of the rebuild's cost but the gradients' memory).

The arithmetic of each chunk is in fp32 (fp64 for fp64 inputs), as a softmax must be
(chapter 2): a 16-bit logit row loses the small probabilities that carry most tokens'
gradient. Tokens whose target is ``ignore_index`` count for nothing, as in ``F.cross_entropy``.
"""

from __future__ import annotations

import torch

from minitrain.kernels.norms import accumulation_dtype


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """The mean cross-entropy of ``x @ weight.T`` over the counted tokens; saves x, weight,
    the targets and one log-sum-exp per token — never a row of logits."""

    @staticmethod
    def forward(ctx, x, weight, targets, chunk_size, ignore_index):
        acc = accumulation_dtype(x)
        counted = targets != ignore_index
        lse = torch.zeros(x.shape[0], dtype=acc, device=x.device)
        total = torch.zeros((), dtype=acc, device=x.device)
        for start in range(0, x.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = (x[rows] @ weight.T).to(acc)  # the only C×V tensor
            lse[rows] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, targets[rows].clamp(min=0).unsqueeze(1)).squeeze(1)
            total += ((lse[rows] - picked) * counted[rows]).sum()
            del logits  # before the next chunk's is built: one chunk alive, not two
        n = counted.sum().clamp(min=1)  # an all-ignored batch gives 0, not NaN
        ctx.save_for_backward(x, weight, targets, lse, n)
        ctx.chunk_size, ctx.ignore_index = chunk_size, ignore_index
        return (total / n).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        x, weight, targets, lse, n = ctx.saved_tensors
        acc = lse.dtype
        scale = grad_loss.to(acc) / n
        counted = targets != ctx.ignore_index
        grad_x = torch.empty(x.shape, dtype=acc, device=x.device)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        w_acc = weight.to(acc)
        for start in range(0, x.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            logits = (x[rows] @ weight.T).to(acc)  # rebuilt: the price of not keeping them
            # d(lse − logit_y)/dlogits = softmax − one-hot(y), computed in the logits' own
            # buffer; an ignored token's row is scaled to 0
            grad_logits = logits.sub_(lse[rows].unsqueeze(1)).exp_()
            grad_logits.scatter_add_(1, targets[rows].clamp(min=0).unsqueeze(1),
                                     -torch.ones_like(lse[rows]).unsqueeze(1))
            grad_logits.mul_((counted[rows].to(acc) * scale).unsqueeze(1))
            torch.matmul(grad_logits, w_acc, out=grad_x[rows])
            grad_w.addmm_(grad_logits.T, x[rows].to(acc))  # in place: no V×d temporary
            del logits, grad_logits
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None, None, None


def chunked_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                 chunk_size: int = 1024, ignore_index: int = -100) -> torch.Tensor:
    """The mean cross-entropy of the logits ``x @ weight.T`` against ``targets``, equal to
    ``F.cross_entropy(x @ weight.T, targets, ignore_index=ignore_index)`` and differentiable
    in ``x`` and ``weight``, holding at most ``chunk_size`` rows of logits at a time.

    ``x``: (tokens, d); ``weight``: (V, d), the head's weight as ``nn.Linear`` stores it;
    ``targets``: (tokens,) integer class indices in [0, V) or ``ignore_index``."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"chunked_linear_cross_entropy: x {tuple(x.shape)} and weight "
                         f"{tuple(weight.shape)} must be (tokens, d) and (V, d)")
    if targets.shape != x.shape[:1]:
        raise ValueError(f"chunked_linear_cross_entropy: targets {tuple(targets.shape)} for "
                         f"{x.shape[0]} tokens")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunked_linear_cross_entropy: chunk_size {chunk_size!r} must be a "
                         "positive integer")
    return ChunkedLinearCrossEntropy.apply(x, weight, targets, chunk_size, ignore_index)


SCALARS = 64  # bytes: the loss, the token count, a scale — a few scalars either way


def loss_peak_bytes(tokens: int, vocab: int, d: int, chunk_size: int | None,
                    dtype: torch.dtype = torch.float32) -> int:
    """The formula for the most memory the loss allocates at once, forward and backward
    together, in bytes (x and the weight themselves not counted), for fp32 and fp64 inputs,
    where no cast copies anything (16-bit inputs add their fp32 copies of W and of the
    gradients). T tokens, vocabulary V, width d, chunks of C tokens; e the logits' element
    size, a the accumulation's (4, or 8 for fp64).

    Unfused (``chunk_size`` None): the T×V logits, the T×V log-softmax autograd keeps, and
    in backward the T×V gradient of the log-softmax's output beside the log-softmax and the
    T×V gradient of the logits: 3·T·V·e at once.

    Chunked: per token a log-sum-exp and a "counted" flag, T·(a + 1); per chunk its target
    indices and two scale vectors, C·(8 + 2a); and the larger of the forward's one chunk of
    C×V logits with at most a C×V temporary of ``logsumexp`` (torch's composite version makes
    one, its CPU kernel does not) and the backward's one chunk of softmax − one-hot beside
    the gradients of x and W (T·d + V·d): max(2·C·V·a, C·V·a + (T + V)·d·a)."""
    if chunk_size is None:
        return 3 * tokens * vocab * dtype.itemsize + SCALARS
    a = 8 if dtype == torch.float64 else 4
    c = min(chunk_size, tokens)
    bookkeeping = tokens * (a + 1) + c * (8 + 2 * a) + SCALARS
    return bookkeeping + max(2 * c * vocab * a, c * vocab * a + (tokens + vocab) * d * a)
