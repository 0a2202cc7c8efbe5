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
    """Group parameters into buckets in the order their gradients become ready.

    ``params`` are in registration order; backward produces gradients roughly in
    *reverse* order, so walk them from last to first. Add each parameter to the open
    bucket; close the bucket once it holds ≥ ``bucket_cap_bytes`` bytes (so a bucket may
    overshoot by its last parameter: one larger than the cap closes the bucket it joins). A bucket is one flat buffer, so a parameter whose dtype or device differs
    from the open bucket's closes that bucket first. Returns lists of indices into
    ``params``: e.g. sizes [4, 4, 4] bytes with a cap of 8 give [[2, 1], [0]].
    """
    ### BEGIN SOLUTION
    # HINT: walk the parameters in the order their gradients arrive in backward, which is not
    # HINT: the order they are listed in; count bytes, not elements
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
