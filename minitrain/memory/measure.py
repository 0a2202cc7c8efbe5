"""Measuring activations: the bytes autograd really saves for backward, and their timeline.

``PeakMemory(device)`` reads a peak where the device can tell it (a GPU's allocator, the
course's accounting on the CPU). Used by notebooks/01_single_device_training.ipynb (``saved_activation_bytes``,
``memory_timeline``), 03_activation_checkpointing (``LiveSavedBytes``, whose ``_pack`` and
``_release`` it prints) and the measurements of later chapters (tensor, pipeline and context
parallelism, flash attention); all import these names from ``minitrain.memory``, which
re-exports them next to the predictions (``block_activation_bytes``, the bytes-per-parameter
table) the measurements are compared with.

Why hooks: every tensor an op saves for backward passes through
``torch.autograd.graph.saved_tensors_hooks``, so counting there is exact and the same on
every device, unlike allocator statistics (CUDA only, and they include the model states).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn


def _is_parameter(t: torch.Tensor, param_storages: set) -> bool:
    # A Linear saves weight.t(): a view whose _base is the Parameter. Storage identity
    # also catches views whose _base was lost, and parameters passed in `exclude`.
    return (
        isinstance(t, nn.Parameter)
        or isinstance(t._base, nn.Parameter)
        or t.untyped_storage().data_ptr() in param_storages
    )


def _parameter_storages(fn, args, exclude) -> set:
    """Storage addresses of the parameters reachable from fn, its args and ``exclude``."""
    ptrs = set()
    for obj in [fn, getattr(fn, "__self__", None), *args, *(exclude or [])]:
        if isinstance(obj, nn.Module):
            ptrs.update(p.untyped_storage().data_ptr() for p in obj.parameters())
        elif isinstance(obj, nn.Parameter):
            ptrs.add(obj.untyped_storage().data_ptr())
    for obj in exclude or []:
        if isinstance(obj, torch.Tensor):
            ptrs.add(obj.untyped_storage().data_ptr())
    return ptrs


def saved_activation_bytes(fn, *args, exclude=None, **kwargs) -> int:
    """Bytes of the distinct storages autograd saves for backward while running ``fn``.

    Uses ``torch.autograd.graph.saved_tensors_hooks``: every tensor an op saves passes
    through the pack hook, so the count is exact and the same on every device. A storage
    saved several times (three Linears saving the same input) is counted once; parameters,
    views of them, and every tensor of ``exclude`` (tensors or modules) are left out.
    """
    param_storages = _parameter_storages(fn, args, exclude)
    seen = {}  # storage address -> tensor; holding it stops the address being reused

    def pack(t):
        if not _is_parameter(t, param_storages):
            seen.setdefault(t.untyped_storage().data_ptr(), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args, **kwargs)
    return sum(t.untyped_storage().nbytes() for ptr, t in seen.items() if ptr != 0)


class LiveSavedBytes:
    """Live bytes autograd holds for backward, over time: ``with tracker:`` around a forward.

    Chapter 1's ``memory_timeline`` and chapter 3's peak measurements both use it. ``_pack``
    counts each saved storage once (parameters and views of them excluded) and hands autograd
    a small holder; autograd drops the holder once the node that saved it has run backward,
    and a ``weakref.finalize`` then un-counts it. Keep the hooks on through backward too and
    recomputed activations (checkpointing) are counted while they live.
    ``.live`` (now), ``.peak`` (highest so far), ``.timeline``: one ``(phase, bytes)`` per
    change, phase being whatever ``.phase`` was set to ("forward", "backward").
    """

    def __init__(self, exclude=()):
        self.param_storages = {p.untyped_storage().data_ptr() for p in exclude}
        self.counts = {}  # storage address -> [nbytes, saved references to it]
        self.live = self.peak = 0
        self.phase = "forward"
        self.timeline = []

    def _pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr == 0 or _is_parameter(t, self.param_storages):  # model state, not activations
            return _Holder(t)
        entry = self.counts.setdefault(ptr, [t.untyped_storage().nbytes(), 0])
        entry[1] += 1
        if entry[1] == 1:
            self._change(entry[0])
        holder = _Holder(t)
        weakref.finalize(holder, self._release, ptr)  # runs when autograd lets go
        return holder

    def _release(self, ptr):
        entry = self.counts[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            del self.counts[ptr]
            self._change(-entry[0])

    def _change(self, delta):
        self.live += delta
        self.peak = max(self.peak, self.live)
        self.timeline.append((self.phase, self.live))

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda h: h.tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


class PeakMemory:
    """The peak bytes a block of code adds, read where the device can tell it.

    ``with PeakMemory(device, exclude=params) as m: ...`` then ``m.peak``: on a GPU the
    allocator's own high-water mark above what was allocated on entry
    (``torch.cuda.max_memory_allocated``: activations, gradients, workspaces, everything);
    on the CPU, which keeps no such statistic, the course's accounting — the peak of the
    storages autograd saves (``LiveSavedBytes``). ``m.source`` says which was read.
    """

    def __init__(self, device, exclude=()):
        self.device = torch.device(device)
        self.exclude, self.peak = exclude, 0
        self.source = "torch.cuda.max_memory_allocated" if self.device.type == "cuda" else (
            "saved activations (LiveSavedBytes)")

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._live = LiveSavedBytes(self.exclude).__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            self._live.__exit__(*exc)
            self.peak = self._live.peak


class _Holder:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


def _state_bytes(optimizer) -> int:
    return sum(
        v.nbytes
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )


def memory_timeline(model: nn.Module, optimizer, loss_fn, batches) -> list[dict]:
    """Live bytes of parameters, gradients, optimizer state and activations over steps.

    ``batches`` is a list of (x, y), one optimizer step each; ``loss_fn(model, x, y)``
    returns the loss. Returns one dict per sample point with keys step, phase
    ("forward", "backward", "step"), label and the four byte counts, sampled after each
    block's forward, at each parameter's gradient, and after step and zero_grad.
    Activations are counted from the storages autograd holds, as they are released.
    On CUDA each point also has ``allocated`` and ``max_allocated`` (the allocator's).
    """
    params = list(dict.fromkeys(model.parameters()))  # tied weights once
    param_bytes = sum(p.nbytes for p in params)
    tracker = LiveSavedBytes(params)
    points, where = [], {"step": 0, "phase": ""}

    def sample(label):
        point = dict(
            where,
            label=label,
            parameters=param_bytes,
            gradients=sum(p.grad.nbytes for p in params if p.grad is not None),
            optimizer=_state_bytes(optimizer),
            activations=tracker.live,
        )
        if params[0].is_cuda:  # the allocator's view beside the course's count
            point["allocated"] = torch.cuda.memory_allocated(params[0].device)
            point["max_allocated"] = torch.cuda.max_memory_allocated(params[0].device)
        points.append(point)

    handles = [
        block.register_forward_hook(lambda m, i, o, n=n: sample(f"block {n}"))
        for n, block in enumerate(getattr(model, "blocks", []))
    ]
    handles += [
        p.register_post_accumulate_grad_hook(lambda p, n=n: sample(n))
        for n, p in model.named_parameters()
    ]
    try:
        for step, (x, y) in enumerate(batches, start=1):
            where.update(step=step, phase="forward")
            sample("start")
            with tracker:
                loss = loss_fn(model, x, y)
            sample("loss")
            where["phase"] = "backward"
            loss.backward()
            del loss
            sample("end of backward")
            where["phase"] = "step"
            optimizer.step()
            sample("optimizer.step")
            optimizer.zero_grad(set_to_none=True)
            sample("zero_grad")
    finally:
        for handle in handles:
            handle.remove()
    return points
