"""Chapter 5 — ZeRO: shard optimizer state, gradients and parameters across data-parallel ranks.

Used by notebooks/05_zero.ipynb (Rajbhandari et al. 2020, "ZeRO"). Files by role:

- ``partition.py``: ``partition_parameters``, which rank owns which parameters (ZeRO-1);
- ``optimizer.py``: ``ShardedOptimizer``, ZeRO-1 as a drop-in optimizer under DDP;
- ``buffers.py``: ``FlatUnit``, parameters packed into one flat buffer padded to N slices;
- ``sharded_units.py``: ``ShardedUnits``, stage 3's per-unit gather/free/prefetch and ordered
  reductions, shared by ``ZeroDataParallel`` and ``minitrain.fsdp``;
- ``units.py``: which modules are stage 3's units (into containers: a unit's forward must
  run), and the check that names a parameter used while its unit is not gathered;
- ``gather_order.py``: stage 3's gathers in unit order when ranks skip units;
- ``data_parallel.py``: ``ZeroDataParallel``, stages 1-3 with optional offload;
- ``step_transfers.py``: what its step moves around the update (stage 1's reduce-scatter,
  gradients to the masters, shards written back and all-gathered);
- ``mixed_precision.py``: low-precision units with fp32 master shards (``compute_dtype``);
- ``accounting.py``: the paper's memory and communication formulas, and the measured bytes;
- ``checkpoint.py``: sharded, atomic checkpoints that reshard onto another world size.
"""

from minitrain.zero.accounting import (
    bytes_sent,
    communication_formula,
    dp_memory_bytes,
    memory_formula,
    optimizer_state_tensors,
    reset_bytes_sent,
    storage_bytes,
)
from minitrain.zero.buffers import FlatUnit
from minitrain.zero.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from minitrain.zero.data_parallel import ZeroDataParallel
from minitrain.zero.optimizer import ShardedOptimizer
from minitrain.zero.partition import partition_parameters

__all__ = [
    "CheckpointError",
    "FlatUnit",
    "ShardedOptimizer",
    "ZeroDataParallel",
    "bytes_sent",
    "communication_formula",
    "dp_memory_bytes",
    "latest_checkpoint",
    "load_checkpoint",
    "memory_formula",
    "optimizer_state_tensors",
    "partition_parameters",
    "reset_bytes_sent",
    "save_checkpoint",
    "storage_bytes",
]
