"""Chapter 4 — data parallelism: every rank trains a replica; gradients are averaged.

Used by notebooks/04_collectives_and_data_parallel.ipynb. Files by role:

- ``bucketing.py``: ``assign_buckets``, the rule that groups gradients (ZeRO uses it too);
- ``data_parallel.py``: ``DataParallel`` (bucketed all-reduce overlapped with backward,
  ``no_sync``) and ``broadcast_from_first_rank``, how replicas start equal;
- ``measure.py``: step time and hidden communication of the variants next to torch DDP.
"""

from minitrain.ddp.bucketing import assign_buckets
from minitrain.ddp.data_parallel import VARIANTS, DataParallel, broadcast_from_first_rank
from minitrain.ddp.measure import (
    hidden_communication_share,
    hidden_share_per_step,
    summarize_shares,
)

__all__ = [
    "VARIANTS",
    "DataParallel",
    "assign_buckets",
    "broadcast_from_first_rank",
    "hidden_communication_share",
    "hidden_share_per_step",
    "summarize_shares",
]
