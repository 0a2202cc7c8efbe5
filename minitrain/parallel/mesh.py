"""A device mesh: the world's ranks arranged as a PP × DP × CP × TP grid, one process group per line.

Chapter 11, notebooks/11_putting_it_together.ipynb. Every parallelism of chapters 4–10 talks
over its *own* group: data parallelism averages gradients over the ranks that hold the same
shard of the model, tensor parallelism all-reduces inside a block, a pipeline sends
activations to the next stage. A mesh gives each rank its coordinates and those groups.

The order of the axes is Megatron-LM's (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters", section 3 and Figure 1; "tp-cp-dp-pp" in
Megatron-Core, innermost first): tensor parallelism is the innermost axis, so the ``tp``
ranks of a group are *consecutive* global ranks and stay inside one node, where bandwidth
is highest (TP communicates in every layer); pipeline parallelism is the outermost axis,
the one that crosses the slowest links (it only sends one activation per micro-batch).

    rank = ((pp_i · DP + dp_i) · CP + cp_i) · TP + tp_i

Expert parallelism (chapter 8; the fifth axis of the Ultra-Scale Playbook's "5-D
parallelism") lives *inside* DP × CP, as in Megatron-Core: the ``dp_cp`` group's ranks, in
order, are cut into groups of ``ep`` consecutive ranks that hold different experts (``"ep"``,
the all-to-all's group), and the ranks at the same place of every such group hold the same
experts (``"expert_dp"``, over which the experts' gradients are averaged). With ep = 1 there
is no all-to-all and ``"expert_dp"`` is ``"dp_cp"``.

Groups are built explicitly with ``dist.new_group``: ``new_group`` is collective over the
default group, so every rank creates *every* group, in the same order, even those it is
not a member of.
"""

from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist

AXES = ("pp", "dp", "cp", "tp")  # outermost first: the rank's digits, most significant first


class _Coords(NamedTuple):
    pp: int
    dp: int
    cp: int
    tp: int


class MeshCoords(_Coords):
    """A rank's coordinates; ``coords.tp`` or ``coords["tp"]``. (A subclass of the named tuple,
    because a ``typing.NamedTuple`` class body cannot call ``super()`` in Python 3.11.)"""

    __slots__ = ()

    def __getitem__(self, key):
        if isinstance(key, str):
            return getattr(self, key)
        return super().__getitem__(key)


def _sizes(dp, tp, pp, cp) -> dict:
    sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
    for axis, n in sizes.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"DeviceMesh: {axis} must be a whole number ≥ 1, got {n!r}")
    return sizes


def rank_coords(rank: int, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1) -> MeshCoords:
    """The (pp, dp, cp, tp) coordinates of global ``rank`` in a PP × DP × CP × TP mesh.

    The rank is a number written in mixed radix with digits (pp, dp, cp, tp), tp the least
    significant: rank = ((pp_i·DP + dp_i)·CP + cp_i)·TP + tp_i. So ranks 0..TP-1 form the
    first tensor-parallel group (adjacent ranks), and pipeline stage s holds ranks
    s·DP·CP·TP .. (s+1)·DP·CP·TP - 1.
    """
    sizes = _sizes(dp, tp, pp, cp)
    world = dp * tp * pp * cp
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a mesh of {world} ranks ({sizes})")
    ### BEGIN SOLUTION
    digits = {}
    for axis in reversed(AXES):  # tp, cp, dp, pp
        rank, digits[axis] = divmod(rank, sizes[axis])
    return MeshCoords(**digits)
    ### END SOLUTION


def axis_groups(axis: str, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1) -> list[list[int]]:
    """Every group along ``axis``: lists of global ranks that differ only in that coordinate.

    E.g. DP2 × TP2 × PP2 (8 ranks): ``axis_groups("tp", ...)`` = [[0, 1], [2, 3], [4, 5],
    [6, 7]], ``axis_groups("pp", ...)`` = [[0, 4], [1, 5], [2, 6], [3, 7]]. Groups are
    listed in order of their lowest rank, and each group's ranks in coordinate order
    (rank i of the group has coordinate i along ``axis``).
    """
    sizes = _sizes(dp, tp, pp, cp)
    if axis not in sizes:
        raise ValueError(f"unknown mesh axis {axis!r}; expected one of {list(AXES)}")
    ### BEGIN SOLUTION
    world = dp * tp * pp * cp
    stride = 1
    for inner in reversed(AXES[AXES.index(axis) + 1 :]):
        stride *= sizes[inner]
    groups = []
    for start in range(world):
        if (start // stride) % sizes[axis] == 0:  # coordinate 0 along axis: a group's first rank
            groups.append([start + i * stride for i in range(sizes[axis])])
    return groups
    ### END SOLUTION


class DeviceMesh:
    """``DeviceMesh(dp=1, tp=1, pp=1, cp=1, ep=1)``: this rank's coordinates and its groups.

    Needs the default process group (``launch`` or ``torchrun``) whose size must equal
    dp·tp·pp·cp. ``.group(axis)`` is this rank's group along "dp", "tp", "pp" or "cp"
    (``"dp_cp"``: data and context parallel together, over which gradients are averaged
    when CP > 1); ``.coords(rank=None)`` a rank's coordinates; ``.ranks(axis)`` the global
    ranks of this rank's group.
    """

    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1):
        self.sizes = _sizes(dp, tp, pp, cp)
        self.dp, self.tp, self.pp, self.cp = dp, tp, pp, cp
        if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1 or (dp * cp) % ep:
            raise ValueError(f"DeviceMesh: ep={ep!r} must be a whole number ≥ 1 dividing "
                             f"dp × cp = {dp * cp} (the expert-parallel ranks are data-parallel)")
        self.ep = ep
        if not dist.is_initialized():
            raise RuntimeError(
                "DeviceMesh needs the default process group: run under minitrain.runtime or torchrun"
            )
        world = dist.get_world_size()
        product = dp * tp * pp * cp
        if product != world:
            raise ValueError(
                f"DeviceMesh: dp={dp} × tp={tp} × pp={pp} × cp={cp} = {product} ranks, "
                f"but the world size is {world}"
            )
        self.world_size, self.rank = world, dist.get_rank()
        self._groups, self._ranks = {}, {}
        me = self.rank
        # every rank creates every group in the same order: new_group is collective
        for axis in (*AXES, "dp_cp"):
            for ranks in self._all_groups(axis):
                group = dist.new_group(ranks, group_desc=axis)  # named: a link per axis
                if me in ranks:
                    self._groups[axis], self._ranks[axis] = group, ranks
        if ep == 1:  # the experts are replicated like every other parameter
            self._groups["expert_dp"] = self._groups["dp_cp"]
            self._ranks["expert_dp"] = self._ranks["dp_cp"]
            return
        for axis in ("ep", "expert_dp"):
            for ranks in self._all_groups(axis):
                group = dist.new_group(ranks, group_desc=axis)
                if me in ranks:
                    self._groups[axis], self._ranks[axis] = group, ranks

    def _all_groups(self, axis: str) -> list[list[int]]:
        if axis in ("ep", "expert_dp"):  # inside each dp_cp group, in its rank order
            ep, lines = self.ep, self._all_groups("dp_cp")
            if axis == "ep":  # ep consecutive ranks: different experts
                return [line[i:i + ep] for line in lines for i in range(0, len(line), ep)]
            return [line[j::ep] for line in lines for j in range(ep)]  # the same experts
        if axis != "dp_cp":
            return axis_groups(axis, **{a: self.sizes[a] for a in ("dp", "tp", "pp", "cp")})
        # ranks sharing (pp, tp): DP and CP flattened, as Megatron's data-parallel-with-CP group
        return [sorted(r for r in range(self.world_size)
                       if (self.coords(r).pp, self.coords(r).tp) == key)
                for key in sorted({(self.coords(r).pp, self.coords(r).tp)
                                   for r in range(self.world_size)})]

    def coords(self, rank: int | None = None) -> MeshCoords:
        """The coordinates of ``rank`` (default: this rank)."""
        return rank_coords(self.rank if rank is None else rank,
                           self.dp, self.tp, self.pp, self.cp)

    def group(self, axis: str):
        """This rank's process group along ``axis`` ("dp", "tp", "pp", "cp", "dp_cp"; with
        ep > 1 also "ep" and "expert_dp")."""
        if axis == "ep" and self.ep == 1:
            raise ValueError("DeviceMesh(ep=1) has no expert-parallel group: every rank holds "
                             "every expert")
        if axis not in self._groups:
            raise ValueError(f"unknown mesh axis {axis!r}; expected one of "
                             f"{[*AXES, 'dp_cp', 'ep', 'expert_dp']}")
        return self._groups[axis]

    def ranks(self, axis: str) -> list[int]:
        """The global ranks of this rank's group along ``axis``, in coordinate order."""
        self.group(axis)
        return list(self._ranks[axis])

    def check_model(self, config) -> None:
        """Raise a clear ValueError if the model cannot be split this way (heads, layers...)."""
        check_layout(config, dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp)

    def __repr__(self):
        ep = f", ep={self.ep}" if self.ep > 1 else ""
        return f"DeviceMesh(dp={self.dp}, tp={self.tp}, pp={self.pp}, cp={self.cp}{ep})"


def check_layout(config, dp=1, tp=1, pp=1, cp=1, seq_len=None, batch_size=None,
                 microbatches=1) -> None:
    """Every divisibility a layout needs, as one clear error naming the numbers."""
    _sizes(dp, tp, pp, cp)
    problems = []
    if config.n_head % tp:
        problems.append(f"tensor parallel size {tp} does not divide {config.n_head} attention heads")
    if config.d_ff % tp:
        problems.append(f"tensor parallel size {tp} does not divide d_ff={config.d_ff}")
    if config.vocab_size % tp:
        problems.append(f"tensor parallel size {tp} does not divide vocab_size={config.vocab_size}")
    if config.n_layer < pp:  # uneven stages are fine (extras to the first, split_blocks)
        problems.append(f"pipeline size {pp} does not divide {config.n_layer} layers into "
                        f"stages of at least one layer")
    s = seq_len or config.seq_len
    if s % (cp * (2 if cp > 1 else 1)):
        problems.append(f"context parallel size {cp} needs a sequence length divisible by "
                        f"{2 * cp} (zigzag halves), got {s}")
    if batch_size is not None and batch_size % (dp * microbatches):
        problems.append(f"global batch {batch_size} is not a multiple of dp={dp} × "
                        f"microbatches={microbatches}")
    if problems:
        raise ValueError("impossible layout: " + "; ".join(problems))
