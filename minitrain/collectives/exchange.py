"""The send/receive steps every collective of ``minitrain.collectives`` is built from.

Used by ``ring.py`` (chapter 4's exercises), the naive and recursive-doubling all-reduces of
``algorithms.py``, and, through ``minitrain.collectives`` (which re-exports every public name
here), ``minitrain.collectives.cost_model`` and
notebooks/04_collectives_and_data_parallel.ipynb (it prints ``exchange``). Here:

* the bytes sent (``bytes_sent`` / ``reset_bytes_sent``): every send below is recorded in the
  runtime's one communication log (source "collectives"), so the notebook can compare what a
  rank sent with the formulas of ``minitrain.collectives``;
* ``exchange``, the simultaneous send + receive a ring step is made of (one NCCL-style group:
  ``batch_isend_irecv``), and the blocking ``send_counted`` / ``recv_nonempty`` the naive and
  recursive-doubling algorithms use, in an order every back-end accepts (no send waits for
  a receive that itself waits for that send);
* the chunk layout (``chunk_sizes``: ``tensor_split``'s) and the scratch buffers the ring
  reuses from call to call;
* ``flat_view`` / ``global_rank``: checking a tensor argument, naming a group's rank globally.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from minitrain.runtime.communication_log import COMMUNICATION_LOG

SOURCE = "collectives"  # this package's records in the communication log


def bytes_sent() -> int:
    """Bytes this process has sent through minitrain.collectives' algorithms since the last reset."""
    return COMMUNICATION_LOG.bytes_sent(SOURCE)


def reset_bytes_sent() -> None:
    COMMUNICATION_LOG.reset(SOURCE)


def record_send(tensor: torch.Tensor) -> None:
    """Record one message of ``tensor``'s bytes sent by this process in the communication log."""
    COMMUNICATION_LOG.record(SOURCE, "send", tensor.numel() * tensor.element_size())


_count = record_send  # the name the algorithms below were written with


def exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int,
             group: ProcessGroup | None = None) -> None:
    """Send ``send`` to global rank ``dst`` while receiving ``recv`` from ``src``; wait for both.

    The send and the receive go out together, as one group (``batch_isend_irecv``): a ring
    of blocking sends would deadlock (every rank waiting for a receiver), and on NCCL even a
    receive posted just *before* its send blocks that send — NCCL runs a rank's operations
    in order, except those of one group (NCCL's "Group calls"; Megatron-LM pairs its
    pipeline messages the same way, ``p2p_communication.py``). Both directions of a link
    then work at once. Empty tensors are not sent at all: both ends know the chunk sizes,
    so they skip the same messages.
    """
    ops = []
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, src, group))
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, dst, group))
        _count(send)
    for request in dist.batch_isend_irecv(ops) if ops else ():
        request.wait()


_scratch = threading.local()  # per thread: DDP may run the ring on a helper thread


def scratch_buffers(numel: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two scratch tensors of ``numel`` elements with ``like``'s dtype and device, reused
    from call to call: fresh large buffers would cost page faults on every all-reduce
    (the memory they keep is the price)."""
    key = (like.dtype, like.device)
    cache = getattr(_scratch, "buffers", None)
    if cache is None:
        cache = _scratch.buffers = {}
    if key not in cache or cache[key].shape[1] < numel:
        cache[key] = torch.empty(2, numel, dtype=like.dtype, device=like.device)
    buf = cache[key]
    return buf[0, :numel], buf[1, :numel]


def send_counted(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None) -> None:
    if tensor.numel():
        dist.send(tensor, dst, group=group)
        _count(tensor)


def recv_nonempty(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None) -> None:
    if tensor.numel():
        dist.recv(tensor, src, group=group)


def global_rank(group, local_rank: int) -> int:
    return local_rank if group is None else dist.get_global_rank(group, local_rank)


def flat_view(tensor: torch.Tensor, name: str, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: {what} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name}: {what} must be contiguous (call .contiguous() first)")
    return tensor.view(-1)


def chunk_sizes(numel: int, world_size: int) -> list[int]:
    """Sizes of the N chunks of an n-element tensor: ``tensor_split`` layout, largest first."""
    base, extra = divmod(numel, world_size)
    return [base + 1 if i < extra else base for i in range(world_size)]
