"""Collectives built from nothing but send and receive: naive, ring and recursive doubling.

Used by notebooks/04_collectives_and_data_parallel.ipynb; the DataParallel of
``minitrain.ddp`` can run on ``ring_all_reduce`` (``communication="ring"``).

All-reduce leaves on every rank the sum of every rank's tensor. Three ways to do it:

* naive: everyone sends its tensor to a root, which adds them up and sends the sum
  back — the root's link carries 2(N-1)·n bytes, so it does not scale;
* ring (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters
  of workstations"; Baidu's "ring all-reduce" 2017): a reduce-scatter followed by an
  all-gather, each N-1 steps in which every rank sends one chunk (n/N elements) to its
  ring successor. Each rank sends 2(N-1)/N·n elements — independent of N: optimal;
* recursive doubling (Thakur, Rabenseifner & Gropp 2005, "Optimization of collective
  communication operations in MPICH", §4): log2(N) steps, each swapping the whole
  tensor with a partner — few messages (good for small tensors), more bytes.

Chunk layout (our decision, documented in docs/ch04_collectives_and_ddp.md): a tensor
of n elements is split like ``flat.tensor_split(N)`` — N contiguous chunks, the first
n mod N of them one element longer. Rank r owns chunk r: ``ring_reduce_scatter``'s
output on rank r has that chunk's size and ``ring_all_gather``'s input on rank r too.
Where N divides n this is exactly torch's ``reduce_scatter_tensor`` /
``all_gather_into_tensor``; chunks may be empty (n < N, or n = 0).

Sums are accumulated in the tensor's own dtype, one rounding per addition, as gloo
does (measured: gloo's fp16 all-reduce of 1, eps/2, eps/2 is not the fp32 sum).

Every rank counts the bytes it sends (``bytes_sent`` / ``reset_bytes_sent``) so the
notebook can compare them with the formulas.

Files by role: ``ring.py`` the ring (chapter 4's exercises); ``pipelined.py`` the same ring
streamed in segments (sending, receiving and adding overlap: gloo's speed on large tensors);
``algorithms.py`` the naive and recursive-doubling all-reduces, the byte formulas
(``predicted_bytes_sent``) and ``all_reduce`` by name; ``auto.py`` the choice of
``all_reduce(..., "auto")`` by the α–β model of ``cost_model.py``, α and β measured once
per group; ``exchange.py`` the send/receive building blocks and the byte
counter. Every public name is importable from ``minitrain.collectives``.
"""

from minitrain.collectives.algorithms import (
    ALGORITHMS,
    all_reduce,
    naive_all_reduce,
    predicted_bytes_sent,
    recursive_doubling_all_reduce,
)
from minitrain.collectives.auto import (
    LINK_COSTS,
    LinkCost,
    LinkCostCache,
    choose_algorithm,
    measure_link_cost,
)
from minitrain.collectives.exchange import (
    bytes_sent,
    chunk_sizes,
    exchange,
    flat_view,
    global_rank,
    record_send,
    recv_nonempty,
    reset_bytes_sent,
    scratch_buffers,
    send_counted,
)

# exercise files copied before the package was split import the helper under this name
from minitrain.collectives.exchange import flat_view as _flat  # noqa: F401, E402
from minitrain.collectives.pipelined import ring_all_reduce_pipelined
from minitrain.collectives.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter

__all__ = [
    "ALGORITHMS", "LINK_COSTS", "LinkCost", "LinkCostCache", "all_reduce", "bytes_sent",
    "choose_algorithm", "chunk_sizes", "exchange", "flat_view", "global_rank",
    "measure_link_cost", "naive_all_reduce", "predicted_bytes_sent", "record_send",
    "recursive_doubling_all_reduce", "recv_nonempty", "reset_bytes_sent", "ring_all_gather",
    "ring_all_reduce", "ring_all_reduce_pipelined", "ring_reduce_scatter", "scratch_buffers",
    "send_counted",
]  # fmt: skip
