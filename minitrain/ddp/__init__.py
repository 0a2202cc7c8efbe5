"""Chapter 4 — data parallelism: every rank trains a replica; gradients are averaged.

Used by notebooks/04_collectives_and_data_parallel.ipynb. Files by role:

- ``replicas.py``: ``broadcast_from_first_rank``, how replicas start equal (ZeRO and FSDP
  use it too), and the check that every rank wraps the same model;
- ``bucketing.py``: ``assign_buckets``, the rule that groups gradients (ZeRO uses it too);
- ``gradient_bucket.py``: ``GradientBucket``, one bucket's flat buffer, its all-reduce and the
  averages it writes back into ``.grad``;
- ``data_parallel.py``: ``DataParallel`` (bucketed all-reduce overlapped with backward,
  ``no_sync``): when gradients enter buckets and when buckets are reduced;
- ``measure.py``: step time and hidden communication of the variants next to torch DDP.
"""

from minitrain.ddp.bucketing import assign_buckets
from minitrain.ddp.data_parallel import VARIANTS, DataParallel
from minitrain.ddp.measure import (
    hidden_communication_share,
    hidden_share_per_step,
    summarize_shares,
)
from minitrain.ddp.replicas import broadcast_from_first_rank

__all__ = [
    "VARIANTS",
    "DataParallel",
    "assign_buckets",
    "broadcast_from_first_rank",
    "hidden_communication_share",
    "hidden_share_per_step",
    "summarize_shares",
]
