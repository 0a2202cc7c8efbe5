"""What one message or collective costs on a modeled link: the α–β formulas (issue 42).

Used by ``link_wrap.py`` (every wrapped torch.distributed call waits for one of these), by
``python -m minitrain.bench link`` and by the notebooks that print "predicted" beside
"measured". ``link`` is anything with ``alpha`` (seconds) and ``bandwidth`` (bytes per second,
per direction per rank): a ``minitrain.runtime.link.Link``.

A message of n bytes costs α + n/β (Hockney 1994, "The communication challenge for MPP").
Collectives cost what NCCL's ring algorithm spends — N-1 or 2(N-1) steps, each one message of
n/N bytes between ring neighbours, every link busy in both directions at once — as Thakur,
Rabenseifner & Gropp 2005 ("Optimization of Collective Communication Operations in MPICH",
§2 and §4) count them, with the computation term γ left out. n is always the *full* tensor's
bytes (the unsharded one for reduce-scatter and all-gather), N the group's size; a group of
one rank costs nothing.
"""

from __future__ import annotations


def _check(nbytes: float, world_size: int) -> None:
    if nbytes < 0:
        raise ValueError(f"a message cannot have {nbytes} bytes")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number ≥ 1, got {world_size!r}")


def p2p_time(nbytes: float, link) -> float:
    """One point-to-point message: α + n/β."""
    _check(nbytes, 1)
    return link.alpha + nbytes / link.bandwidth


def all_reduce_time(nbytes: float, world_size: int, link) -> float:
    """Ring all-reduce: a reduce-scatter then an all-gather, 2(N−1)(α + n/(Nβ))."""
    _check(nbytes, world_size)
    N = world_size
    return 0.0 if N == 1 else 2 * (N - 1) * (link.alpha + nbytes / (N * link.bandwidth))


def reduce_scatter_time(nbytes: float, world_size: int, link) -> float:
    """Ring reduce-scatter of an n-byte input: (N−1)(α + n/(Nβ))."""
    _check(nbytes, world_size)
    N = world_size
    return 0.0 if N == 1 else (N - 1) * (link.alpha + nbytes / (N * link.bandwidth))


def all_gather_time(nbytes: float, world_size: int, link) -> float:
    """Ring all-gather into an n-byte output: (N−1)(α + n/(Nβ))."""
    return reduce_scatter_time(nbytes, world_size, link)


def all_to_all_time(nbytes: float, world_size: int, link) -> float:
    """All-to-all of an n-byte buffer (n/N to each rank), N−1 pairwise steps:
    (N−1)(α + n/(Nβ))."""
    return reduce_scatter_time(nbytes, world_size, link)


def broadcast_time(nbytes: float, world_size: int, link) -> float:
    """Pipelined ring broadcast (the message cut into many pieces that follow each other down
    the chain): (N−1)α + n/β."""
    _check(nbytes, world_size)
    N = world_size
    return 0.0 if N == 1 else (N - 1) * link.alpha + nbytes / link.bandwidth


COLLECTIVE_TIMES = {
    "all_reduce": all_reduce_time,
    "reduce_scatter": reduce_scatter_time,
    "all_gather": all_gather_time,
    "all_to_all": all_to_all_time,
    "broadcast": broadcast_time,
}


def collective_time(kind: str, nbytes: float, world_size: int, link) -> float:
    """The formula of collective ``kind`` (a key of ``COLLECTIVE_TIMES``)."""
    if kind not in COLLECTIVE_TIMES:
        raise ValueError(f"unknown collective {kind!r}; expected one of {list(COLLECTIVE_TIMES)}")
    return COLLECTIVE_TIMES[kind](nbytes, world_size, link)
