"""Which gradients share a bucket: the one bucketing rule of data parallelism.

Chapter 4, notebooks/04_collectives_and_data_parallel.ipynb; used by ``DataParallel`` and by
chapter 5's ZeRO (its reduce-scatter buckets). Backward produces gradients in roughly the
reverse of the order the parameters were registered, so buckets are filled in that order and
each can be reduced as soon as its last gradient is ready (Li et al. 2020, "PyTorch
Distributed", section 3.2.3).
"""

from __future__ import annotations

import torch


def assign_buckets(params: list[torch.Tensor], bucket_cap_bytes: float) -> list[list[int]]:
    """Group parameters into buckets, each filled by gradients arriving one after another.

    ``params`` are in registration order (the order forward uses them); a bucket is one flat
    buffer whose all-reduce starts when its last gradient arrives in backward, so a bucket
    holds parameters whose gradients arrive together, in the order backward produces them.
    Returns a list of buckets, each a list of indices into ``params``: every index exactly
    once, each bucket's indices in the order their gradients arrive, the buckets in the
    order they fill. The rules (each graded):
    - a bucket closes once its bytes (``numel() * element_size()``) reach
      ``bucket_cap_bytes``, so it may overshoot by its last parameter, and a parameter
      larger than the cap joins the open bucket and closes it (cap 0: one bucket per
      parameter; ``math.inf``: one bucket);
    - a bucket holds one dtype and one device: a parameter whose dtype or device differs
      from the open bucket's closes that bucket first.
    """
    ### BEGIN SOLUTION
    buckets, current, current_bytes = [], [], 0
    for i in reversed(range(len(params))):
        p = params[i]
        if current and (p.dtype, p.device) != (params[current[0]].dtype, params[current[0]].device):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += p.numel() * p.element_size()
        if current_bytes >= bucket_cap_bytes:
            buckets.append(current)
            current, current_bytes = [], 0
    if current:
        buckets.append(current)
    return buckets
    ### END SOLUTION
