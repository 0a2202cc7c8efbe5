"""``all_reduce(tensor, "auto")``: the α–β model of chapter 4 picks the algorithm.

Used by ``minitrain.collectives.all_reduce`` (``algorithm="auto"``), by DataParallel's
``communication="auto"`` and by notebooks/04_collectives_and_data_parallel.ipynb, which
shows the crossover the model predicts next to the one measured.

The model (``cost_model.py``; Hockney 1994; Thakur, Rabenseifner & Gropp 2005) prices an
all-reduce of n bytes on N ranks as a count of messages times the latency α plus the bytes
on the busiest link times β, plus γ per byte added outside communication (``LinkCost.gamma``;
without it, two ranks would always pick recursive doubling, whose one swap costs α less than
the ring's two steps, though its add of the whole tensor is not hidden as the pipelined
ring's are). ``choose_algorithm`` takes the cheapest of naive, recursive
doubling and ring under it: few large messages (recursive doubling, log2 N swaps) for small
n, the bandwidth-optimal ring for large n. It is the notebook's model that decides, so what
the learner fitted is what runs.

α and β are measured once per process group and kept (``LinkCost``, ``LinkCostCache``):

* the measurement is a collective (every rank of the group runs a few ring steps and keeps
  the slowest rank's time of each, agreed by an all-reduce), so every rank fits the same α
  and β and computes the same choice for the same message — ranks that picked different
  algorithms would deadlock;
* where it is kept is explicit (our choice, recorded in docs/design.md): ``all_reduce``
  takes ``link=`` — a ``LinkCost`` you measured or made up (no measurement then), or a
  ``LinkCostCache`` you own; without it the process's ``LINK_COSTS`` cache is used, keyed by
  the group object (``group=None`` → the default group's object, so a new default group
  after ``destroy_process_group`` is measured anew). A torch ``ProcessGroup`` takes no
  attributes, so the cache cannot live on the group itself; ``LINK_COSTS.clear()`` forgets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from minitrain.collectives.cost_model import fit_alpha_beta, predict_all_reduce, typical_seconds
from minitrain.collectives.exchange import exchange
from minitrain.runtime import slowest_rank_seconds
from minitrain.runtime.point_to_point import ring_neighbours

# the order breaks ties: the first algorithm of equal predicted time wins, on every rank
CANDIDATES = ("recursive_doubling", "ring", "naive")
PROBE_BYTES = (4 * 1024, 256 * 1024, 1024 * 1024)  # the ring steps α and β are fitted to
PROBE_REPS = 5


@dataclass(frozen=True)
class LinkCost:
    """The α–β model's two numbers for one process group: α seconds per message, β seconds
    per byte (1/β is the bandwidth). What a rank *believes* of its network — fitted, or given —
    beside ``minitrain.runtime.link.Link``, what the modeled network *is* (α and bytes per
    second); ``all_reduce(..., link=a_link)`` takes a Link's figures as known exactly."""

    alpha: float
    beta: float
    gamma: float = 0.0  # seconds per byte added locally (the model's reduction term, γ)

    def __post_init__(self):
        if not (self.alpha >= 0 and self.beta >= 0 and self.gamma >= 0):
            raise ValueError(
                f"LinkCost: alpha, beta and gamma must be ≥ 0, got {self.alpha}, {self.beta}, "
                f"{self.gamma}"
            )


def _reduction_seconds(algorithm: str, nbytes: float, world_size: int, gamma: float) -> float:
    """Time spent adding *outside* communication (γ·bytes; Thakur et al. 2005, §4's γ term):
    recursive doubling adds the whole tensor after each swap, the naive root adds N-1
    tensors; the pipelined ring adds each segment while the next ones travel, so its adds
    are hidden behind its sends and cost nothing extra here."""
    if algorithm == "recursive_doubling":
        power = 1 << (world_size.bit_length() - 1)
        return ((power.bit_length() - 1) + (power != world_size)) * nbytes * gamma
    if algorithm == "naive":
        return (world_size - 1) * nbytes * gamma
    return 0.0


def choose_algorithm(nbytes: int, world_size: int, link: LinkCost) -> str:
    """The algorithm (of ``CANDIDATES``) the α–β model predicts fastest for ``nbytes``, with
    the time of the adds not hidden behind communication (``link.gamma``) added."""
    return min(
        CANDIDATES,
        key=lambda a: predict_all_reduce(a, nbytes, world_size, link.alpha, link.beta)
        + _reduction_seconds(a, nbytes, world_size, link.gamma),
    )


def measure_link_cost(group: ProcessGroup | None = None, device: torch.device | str = "cpu",
                      sizes: tuple[int, ...] = PROBE_BYTES, reps: int = PROBE_REPS) -> LinkCost:
    """Run on every rank of ``group``: fit α and β to ring steps (send m bytes to the successor
    while receiving m from the predecessor; best of ``reps`` per size, as
    ``cost_model.measure_ring_step``), with ``device``'s tensors. Every rank returns the same
    ``LinkCost`` (the slowest rank's α and β)."""
    prev_rank, next_rank = ring_neighbours(group)
    seconds = []
    for m in sizes:
        send = torch.ones(m // 4, device=device)
        recv = torch.empty(m // 4, device=device)
        step = lambda s=send, r=recv: exchange(s, next_rank, r, prev_rank, group)  # noqa: E731
        # after a warm-up (the connection, the allocator); the best of reps, or on a modeled
        # link the median from the last rank's start (cost_model.typical_seconds)
        seconds.append(typical_seconds(step, reps, device, group))
    # every rank holds the same times (each is the slowest rank's), so the same fit
    alpha, beta = fit_alpha_beta(list(sizes), seconds)
    a = torch.ones(sizes[-1] // 4, device=device)
    b = torch.ones(sizes[-1] // 4, device=device)
    a.add_(b)  # warm-up
    add = min(slowest_rank_seconds(a.add_, b, device=device, group=group)[0] for _ in range(reps))
    # a fit on noisy times can come out slightly negative; the model needs costs ≥ 0
    return LinkCost(max(alpha, 1e-7), max(beta, 1e-13), add / sizes[-1])


class LinkCostCache:
    """α and β per process group, measured the first time a group asks (module docstring)."""

    def __init__(self):
        self._costs: dict = {}
        self.measurements = 0  # how many times a group was measured (tests check it is once)

    def get(self, group: ProcessGroup | None, device: torch.device | str) -> LinkCost:
        key = dist.group.WORLD if group is None else group
        if key not in self._costs:
            self._costs[key] = measure_link_cost(group, device)
            self.measurements += 1
        return self._costs[key]

    def set(self, group: ProcessGroup | None, link: LinkCost) -> None:
        """Use ``link`` for ``group`` from now on (set it alike on every rank)."""
        self._costs[dist.group.WORLD if group is None else group] = link

    def clear(self) -> None:
        self._costs.clear()


LINK_COSTS = LinkCostCache()  # this process's cache, used when all_reduce is given no link=


def resolve_link(link: LinkCost | LinkCostCache | None, group: ProcessGroup | None,
                 device: torch.device | str) -> LinkCost:
    """The ``LinkCost`` ``all_reduce(..., link=link)`` uses for ``group`` (measuring if needed)."""
    if isinstance(link, LinkCost):
        return link
    if hasattr(link, "alpha") and hasattr(link, "bandwidth"):
        # a network's figures (minitrain.runtime.link.Link, or any α and bytes per second):
        # what this rank would fit on it, known exactly, with no adding cost of its own
        return LinkCost(link.alpha, 1.0 / link.bandwidth)
    if link is None:
        link = LINK_COSTS
    if not isinstance(link, LinkCostCache):
        raise TypeError(
            f"all_reduce: link must be a LinkCost, a LinkCostCache, a Link (alpha, bandwidth) or "
            f"None, got {type(link).__name__}"
        )
    return link.get(group, device)
