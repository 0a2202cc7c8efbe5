"""Every tensor a block of code allocates, live and at peak — on any device, the CPU included.

Chapter 12 (notebooks/12_kernels_and_compilers.ipynb) measures what a loss or a fused
operator really holds at its worst moment, temporaries included: the logits a cross-entropy
builds and frees, the gradient buffers of backward. ``PeakMemory`` (measure.py) reads a GPU's
allocator, and on the CPU only what autograd saves; ``LiveAllocations`` counts allocations
themselves, through a ``TorchDispatchMode``: every op's outputs pass through it, a storage
met for the first time (not one of the op's inputs': a view or an in-place result) is a new
allocation, and a ``weakref.finalize`` on each tensor holding it un-counts it when the last
one dies. torch keeps a tensor's Python object alive as long as C++ (autograd's saved
tensors, the engine's gradient buffers) still uses it, so the count follows the real lifetime.

Backward runs on the calling thread for CPU tensors and sees the mode too; on a GPU the
allocator's own high-water mark (``PeakMemory``) is the better number.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class LiveAllocations(TorchDispatchMode):
    """``with LiveAllocations() as mem: ...`` — ``mem.live`` bytes allocated inside and still
    alive, ``mem.peak`` the most at any moment, both counting distinct storages."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._storages: dict[int, list[int]] = {}  # address -> [bytes, tensors holding it]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._hold(t, inputs)
        return out

    def _hold(self, t: torch.Tensor, inputs: set) -> None:
        key = _storage_key(t)
        entry = self._storages.get(key)
        if entry is None:
            if key == 0 or key in inputs:  # empty, or a view / in-place result of an input
                return
            entry = self._storages[key] = [t.untyped_storage().nbytes(), 0]
            self.live += entry[0]
            self.peak = max(self.peak, self.live)
        entry[1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._storages.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._storages[key]
            self.live -= entry[0]
