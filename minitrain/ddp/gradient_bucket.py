"""A bucket: several gradients in one flat buffer, summed over the ranks by one all-reduce.

Chapter 4, notebooks/04_collectives_and_data_parallel.ipynb; used by ``DataParallel``
(data_parallel.py), which decides *when* gradients go into a bucket and when its all-reduce
starts. Which gradients share a bucket is bucketing.py's rule. One message per bucket pays
the per-message latency (α) once for all its gradients instead of once per parameter (Li et
al. 2020, "PyTorch Distributed", §3.2.3).

How a bucket is summed (``communication``): "torch" uses ``dist.all_reduce(async_op=True)``;
"ring" runs ``minitrain.collectives.ring_all_reduce`` (a learner's, when graded) on a helper
thread so it still overlaps backward; "auto" runs ``minitrain.collectives.all_reduce(...,
"auto")`` there (the α–β model's pick for the bucket's size: recursive doubling for small
buckets, the pipelined ring for large ones); any ``fn(tensor, group)`` works too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from minitrain import collectives
from minitrain.ddp.bucketing import assign_buckets
from minitrain.runtime import trace


class GradientBucket:
    """One flat gradient buffer and the parameters whose gradients live in it.

    After the gradients the buffer carries one more number per parameter, its "used" flag:
    1 if this rank's backward reached the parameter. The all-reduce sums the flags with the
    gradients, so it costs no extra message, and afterwards every rank reads the same count of
    ranks that used each parameter (torch DDP's ``find_unused_parameters``; Li et al. 2020,
    §3.2.3).
    """

    def __init__(self, index: int, params: list[nn.Parameter]):
        self.index = index
        self.params = params
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.buffer = torch.zeros(
            self.offsets[-1] + len(params), dtype=params[0].dtype, device=params[0].device
        )
        # each parameter's slice, made once: a slice per gradient per step is Python work in
        # backward's hooks, which torch DDP's C++ reducer does not pay
        self._views = [self.buffer[a:b] for a, b in zip(self.offsets, self.offsets[1:])]
        # the flags: small integer counts, exact in any float dtype (bf16: up to 256 ranks).
        # Backward's hooks set them on the buffer's device as gradients arrive (``mark_used``:
        # one fill of a one-element view each, queued like the gradient's copy). Kept in a
        # Python list and copied in at launch, they were a pageable host-to-device copy per
        # bucket: on a GPU the host waits there, and the overlap is gone (issue 41)
        self.used = self.buffer[self.offsets[-1] :]
        self._used_views = [self.used[k] for k in range(len(params))]
        self.ready = 0  # parameters whose gradient has been copied in this step
        self.wait = None  # waits for the running all-reduce, returns when it ended
        self.launched_at = 0.0

    def reset(self) -> None:
        """Empty for the next step: no gradient copied in, no all-reduce running, none used."""
        self.ready, self.wait = 0, None
        self.used.zero_()  # after the last all-reduce: its summed flags were read

    def mark_used(self, k: int) -> None:
        """This rank's backward reached parameter k (its flag, set on the buffer's device)."""
        self._used_views[k].fill_(1.0)

    def view(self, k: int) -> torch.Tensor:
        """The slice of the buffer that holds parameter k's gradient."""
        return self._views[k]

    def start_all_reduce(self, group, communication, executor) -> None:
        """Start summing the buffer over the ranks of ``group``; ``self.wait()`` then waits for
        the sum and returns when it ended. ``communication``: "torch", "ring" or
        ``fn(tensor, group)``; ``executor``: the helper thread that runs the last two (one
        thread for all buckets, so they stay in order; unused with "torch")."""
        # (its marks on the buffer's device: there, a GPU's events; issue 41)
        self.launched_at = trace.now(self.buffer.device)  # the flags are in the buffer already
        if communication == "torch":
            work = dist.all_reduce(self.buffer, group=group, async_op=True)
            self.wait = torch_wait(work, self.buffer.device)
            # "asynchronous" need not mean the caller goes on at once (gloo on a busy CPU can
            # hold it for most of the all-reduce): backward computes nothing meanwhile
            trace.record("launching all-reduce (backward waits)", "idle", self.launched_at,
                         trace.now(self.buffer.device))
            return
        fn = communication
        if fn == "ring":
            fn = collectives.ring_all_reduce  # at call time: a learner's version when graded
        elif fn == "auto":
            fn = _auto_all_reduce

        def run(buffer=self.buffer, group=group):
            fn(buffer, group)
            return trace.now(buffer.device)  # on a GPU: after the stream's wait for the sum

        self.wait = executor.submit(run).result

    def write_averages(self, hooks) -> None:
        """Once the all-reduce has ended: write each parameter's average into ``param.grad``
        and call every ``hook(param)`` on it. A parameter whose summed "used" flag is 0 was
        used by no rank: its ``.grad`` is left as it was (``None`` stays ``None``)."""
        used = self.used.tolist()  # the summed flags, read once (one device sync, not one each)
        for k, p in enumerate(self.params):
            if used[k] == 0:
                continue  # no rank used it: every rank leaves .grad alone, as torch DDP
            grad = self._views[k].view_as(p)
            if p.grad is None:
                p.grad = grad.clone()
            else:
                p.grad.copy_(grad)
            for hook in hooks:
                hook(p)


def _auto_all_reduce(tensor: torch.Tensor, group) -> None:
    collectives.all_reduce(tensor, "auto", group)


def make_buckets(params: list[nn.Parameter], bucket_cap_mb: float) -> list[GradientBucket]:
    """One ``GradientBucket`` per group of ``assign_buckets`` (``bucket_cap_mb`` in MiB),
    numbered in the order backward fills them."""
    cap = bucket_cap_mb * 1024 * 1024
    return [
        GradientBucket(b, [params[i] for i in idx])
        for b, idx in enumerate(assign_buckets(params, cap))
    ]


def torch_wait(work, device=None):
    """A function that waits for ``work`` and returns when it ended (a mark on ``device``'s
    clock: ``trace.now``). While tracing, the future's callback marks the end
    (``trace.end_mark``): on gloo the moment the collective completes, so timelines show its
    real end; it runs Python on gloo's thread, which then waits for the interpreter while
    backward runs its hooks (the next bucket's all-reduce waits with it: DDP's step 4-8 %
    slower, measured). On NCCL the callback runs at launch, and its mark is an event on a
    stream that waits for the collective. Untraced, the end is when the wait returns."""
    if not trace.enabled():
        return lambda: (work.wait(), trace.now())[1]
    ended = trace.end_mark(work, device)
    return lambda: (work.wait(), ended.wait())[1]
