"""ZeRO's flat, padded buffers, and the small tools that launch and time its collectives.

Used by minitrain.zero. Every group of parameters ZeRO shards ("unit": a bucket in stages
1-2, a block in stage 3) is packed into one flat buffer padded to a multiple of N, so any
parameter size works with any world size: rank r owns the r-th equal slice, and
reduce-scatter / all-gather move whole slices (Rajbhandari et al. 2020, §5; the padding is
under N elements per unit).
"""

from __future__ import annotations

import torch

from minitrain import trace


class _Unit:
    """Parameters packed in one flat buffer, padded to a multiple of N; rank r owns slice r.

    ``full`` holds every parameter (the module's parameters become views of it); ``shard`` is
    this rank's slice, the tensor the optimizer updates (a view of ``full`` in stages 1-2, its
    own storage in stage 3, where ``full`` is freed between uses: storage resized to 0).
    """

    def __init__(self, name, named, world, rank, own_shard):
        self.name, self.names = name, [n for n, _ in named]
        self.params = [p for _, p in named]
        self.offsets = [0]
        for p in self.params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.numel = self.offsets[-1]
        self.shard_numel = -(-self.numel // world)  # ceil: the padding is < N elements
        self.padded = self.shard_numel * world
        ref = self.params[0]
        self.full = torch.zeros(self.padded, dtype=ref.dtype, device=ref.device)
        with torch.no_grad():
            for k, p in enumerate(self.params):
                self.full[self.offsets[k] : self.offsets[k + 1]].copy_(p.reshape(-1))
                p.data = self.slot(self.full, k).view_as(p)
        mine = self.full[rank * self.shard_numel : (rank + 1) * self.shard_numel]
        self.shard = mine.clone() if own_shard else mine
        self.master = None  # the nn.Parameter the optimizer steps (shard itself, or a host copy)
        self.grad_full = None  # full padded gradient buffer (stage 1: always; 2-3: transient)
        self.grad_shard = None  # this rank's averaged gradient slice
        self.ready, self.state, self.work, self.launched = 0, "full", None, 0.0
        self.backward_start = None  # stage 3: when this unit's backward began (for the trace)

    def slot(self, flat, k):
        return flat[self.offsets[k] : self.offsets[k + 1]]


def _bucket_params(named, cap_bytes):
    """Stage 1-2 buckets: parameters in reverse registration order (the order backward makes
    their gradients), a bucket closed once it holds ≥ cap_bytes."""
    buckets, current, size = [], [], 0
    for name, p in reversed(named):
        current.append((name, p))
        size += p.numel() * p.element_size()
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


def _timed(work):
    """A launched collective plus a future of the time it *ends*: the callback runs at
    completion (not when we wait), so a prefetched gather shows its true length in the trace.
    (gloo's reduce-scatter has no future: there the end is when the wait returns.)"""
    try:
        return work, work.get_future().then(lambda _: trace.now())
    except RuntimeError:
        return work, None


def _wait(timed) -> float:
    """Wait for a ``_timed`` collective; return when it ended."""
    timed[0].wait()
    return trace.now() if timed[1] is None else timed[1].wait()


def _ignore_grad(fn, index, grad):
    fn(index)


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out] if out.requires_grad else []
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []
