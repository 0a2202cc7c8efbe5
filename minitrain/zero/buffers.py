"""ZeRO's flat, padded buffers, and the small tools that launch and time its collectives.

Chapter 5, used by ZeroDataParallel (data_parallel.py) and its checkpoints. Every group of parameters ZeRO shards ("unit": a bucket in stages
1-2, a block in stage 3) is packed into one flat buffer padded to a multiple of N, so any
parameter size works with any world size: rank r owns the r-th equal slice, and
reduce-scatter / all-gather move whole slices (Rajbhandari et al. 2020, §5; the padding is
under N elements per unit).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minitrain.runtime import trace


# torch 2.13 renamed the tensor collectives (older versions have only the second names); looked
# up at each call, so a wrapper installed after this import (the modeled link of
# minitrain.runtime.link, the strict canary, a test counting collectives) sees every call
def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """Reduce-scatter ``input`` (N equal slices) into ``output`` (this rank's slice)."""
    collective = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return collective(output, input, op=op, group=group, async_op=async_op)


def all_gather_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """All-gather every rank's ``input_tensor`` (one slice) into ``output_tensor``."""
    collective = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return collective(output_tensor, input_tensor, group=group, async_op=async_op)


class FlatUnit:
    """Parameters packed in one flat buffer, padded to a multiple of N; rank r owns slice r.

    ``full`` holds every parameter (the module's parameters become views of it); ``shard`` is
    this rank's slice, the tensor the optimizer updates (a view of ``full`` in stages 1-2, its
    own storage in stage 3, where ``full`` is freed between uses: storage resized to 0).
    """

    def __init__(self, name, named, world, rank, own_shard):
        self.name, self.names = name, [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shapes = [p.shape for p in self.params]  # (a freed parameter has zero elements)
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
        self.keep_full = False  # FSDP's replicated parameters: whole on every rank, never freed

    def slot(self, flat, k):
        return flat[self.offsets[k] : self.offsets[k + 1]]

    def show_params(self) -> None:
        """Point the module's parameters at their slots of ``full`` (just gathered)."""
        for k, p in enumerate(self.params):
            p.data = self.slot(self.full, k).view(self.shapes[k])

    def hide_params(self) -> None:
        """Point the module's parameters at one empty tensor while ``full`` is freed: an op
        on them then fails (a shape error) instead of reading freed memory — a view of a
        storage resized to 0 keeps its shape, and reading it is undefined. (PyTorch's FSDP1
        does the same with the parameters outside a rank's shard.) Autograd saved the
        parameters themselves, so a backward after ``show_params`` sees the data again."""
        empty = self.full.new_empty(0)
        for p in self.params:
            p.data = empty


def timed(work):
    """A launched collective plus a future of the mark at which it *ends* (``trace.end_mark``:
    on gloo the callback runs at completion, not when we wait, so a prefetched gather shows
    its true length in the trace; on NCCL it marks the end with an event on the device of the
    collective's tensors). (gloo's reduce-scatter has no future: there the end is when the
    wait returns: ``wait_timed``.)"""
    try:
        return work, trace.end_mark(work)
    except RuntimeError:
        return work, None


def wait_timed(launched, device=None):
    """Wait for a collective started with ``timed``; return the mark of its end (without a
    future: the wait's return, on the clock of ``device``, where its tensors live)."""
    launched[0].wait()
    return trace.now(device) if launched[1] is None else launched[1].wait()
