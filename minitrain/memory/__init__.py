"""Where the memory of a training step goes (chapter 1, notebooks/01_single_device_training.ipynb).

- ``formulas.py``: the predictions — bytes per parameter of each precision recipe
  (``estimate_training_memory``), activation bytes per block (Korthikanti et al. 2022);
- ``measure.py``: the measurements they are checked against — the storages autograd saves
  (``saved_activation_bytes``, ``LiveSavedBytes``) and a step's memory timeline;
- ``allocations.py``: every allocation of a block of code, temporaries included, live and at
  peak (``LiveAllocations``; chapter 12).
"""

from minitrain.memory.allocations import LiveAllocations
from minitrain.memory.formulas import (
    BYTES_PER_PARAMETER,
    block_activation_bytes,
    bytes_per_parameter,
    estimate_training_memory,
    model_activation_bytes,
)
from minitrain.memory.measure import (
    LiveSavedBytes,
    PeakMemory,
    memory_timeline,
    saved_activation_bytes,
)

__all__ = [
    "BYTES_PER_PARAMETER",
    "LiveAllocations",
    "LiveSavedBytes",
    "PeakMemory",
    "block_activation_bytes",
    "bytes_per_parameter",
    "estimate_training_memory",
    "memory_timeline",
    "model_activation_bytes",
    "saved_activation_bytes",
]
