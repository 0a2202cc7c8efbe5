"""Layout-free dropout: each mask a pure function of its element's key and global coordinates.

Dropout (Srivastava et al. 2014) drawn from a random *stream* depends on how many numbers
were drawn before, and in what order: a data-parallel rank drawing for its half of the batch,
a tensor-parallel rank for its heads, a pipeline stage for its blocks, each draws other masks
than one process does, and the loss curve leaves the single process's. A counter-based
generator (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3") has no stream:
its number for counter c under key k is a fixed function f(k, c), so any process can compute
any element's number alone, in any order. FlashAttention draws its dropout so (Philox, one of
Salmon et al.'s generators, keyed per element of the score matrix), which is why its tiles
need not store a mask.

Here the key is (seed, step, layer, site) and the counter is the element's *global*
coordinates — for the residual stream and the embedding (global row of the batch, position
in the whole sequence, channel), for the attention probabilities (row, global head, query
position, key position) — each layout computes them for the elements it holds, so dp, tp
(± SP), pp and cp drop exactly the elements one process drops. The function is SplitMix64's
(Steele, Lea & Flood 2014) applied to one coordinate after the other,
``z ← mix(z + (c + 1)·γ)``, ``mix`` the finalizer's 64-bit multiply–xorshift bijection, in
int64 torch ops on the activation's device (wrap-around multiplication is the arithmetic it
needs). The top 53 bits of the last word, compared with p·2⁵³, decide. The mask is a
``bool`` tensor, as before (1 byte per element: chapter 1's memory counts it).

- ``keep_mask(p, words, coords)``: the pure function;
- ``DropoutKey``: one forward's key (seed, step, global rows, positions);
- ``DropoutKeys``: what a GPT's dropout sites read the key in effect from (``GPT.dropout_keys``;
  a trainer sets ``current`` before each micro-batch's forward; ``None``: torch's generator,
  chapters 1–3). Activation checkpointing replays it (``get_state`` / ``set_state``), so a
  recompute in backward — after other micro-batches' forwards — uses its own micro-batch's key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment: 2^64 / golden ratio, odd
MIX = ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, None))
SITES = {"embedding": 0, "attention": 1, "attention_output": 2, "mlp_output": 3}
UNIFORM_BITS = 53  # the top bits of a hash compared with p: drop probability p within 2^-53


def _int64(u: int) -> int:
    """A 64-bit word as the signed int64 torch holds it (the same bits)."""
    return u - (1 << 64) if u >= 1 << 63 else u


def _mix_int(z: int) -> int:
    """SplitMix64's finalizer on a Python int (the key's words)."""
    for shift, factor in MIX:
        z ^= z >> shift
        if factor is not None:
            z = (z * factor) & MASK64
    return z


def _mix(z: torch.Tensor) -> torch.Tensor:
    """The same finalizer on int64 tensors: torch's ``>>`` on int64 copies the sign bit, so
    the shift is made logical by masking the top bits off (else the map is no bijection)."""
    for shift, factor in MIX:
        z = z ^ ((z >> shift) & ((1 << (64 - shift)) - 1))
        if factor is not None:
            z = z * _int64(factor)  # wraps modulo 2^64: the multiply of the hash
    return z


def keep_mask(p: float, words: Sequence[int], coords: Sequence[torch.Tensor]) -> torch.Tensor:
    """The keep mask (bool, True = kept) of a tensor whose dimension d has global coordinates
    ``coords[d]`` (1-D integer tensors, on the tensor's device), under key ``words`` (ints:
    seed, step, layer, site). Element (i, j, …) is dropped iff the hash of (words…,
    coords[0][i], coords[1][j], …) falls below p: a pure function, so a slice of the mask is
    the mask of the sliced coordinates — whatever a rank holds, it draws one process's mask."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p!r}")
    z = 0
    for w in words:  # the key: one word, mixed on the host
        z = _mix_int((z + (int(w) + 1) * GAMMA) & MASK64)
    h = torch.full((), _int64(z), dtype=torch.int64, device=coords[0].device)
    n = len(coords)
    for d, c in enumerate(coords):  # one coordinate after the other, broadcast: an outer product
        c = c.to(torch.int64).reshape([-1 if k == d else 1 for k in range(n)])
        h = _mix(h + (c + 1) * _int64(GAMMA))
    uniform = (h >> (64 - UNIFORM_BITS)) & ((1 << UNIFORM_BITS) - 1)
    return uniform >= round(p * (1 << UNIFORM_BITS))


@dataclass(frozen=True)
class DropoutKey:
    """One forward's key. ``rows``: each sequence's index in the step's *global* batch;
    ``positions``: where the forward's tokens sit in the whole sequence (what attention sees:
    0..s-1, or a context-parallel shard's); ``residual_positions``: where the tokens of the
    residual stream sit on this rank (sequence parallelism holds a slice; None: ``positions``)."""

    seed: int
    step: int
    rows: torch.Tensor
    positions: torch.Tensor
    residual_positions: torch.Tensor | None = None


@dataclass(frozen=True)
class DropoutSite:
    """A dropout site under a key: ``layer`` (the block's *global* index: a pipeline stage holds
    blocks k..k+n), ``name`` (a key of ``SITES``), ``first_head`` (the global index of the first
    head this rank holds: tensor parallelism splits them), ``queries`` / ``keys`` (the
    attention's query and key positions when they are not the key's ``positions``: context
    parallelism's gathered keys)."""

    key: DropoutKey
    layer: int
    name: str
    first_head: int = 0
    queries: torch.Tensor | None = None
    keys: torch.Tensor | None = None

    def at_positions(self, queries: torch.Tensor, keys: torch.Tensor) -> DropoutSite:
        """The site with the attention's own query and key positions."""
        return replace(self, queries=queries, keys=keys)

    def keep(self, x: torch.Tensor, p: float) -> torch.Tensor:
        """The keep mask of ``x``: (batch, seq, channel) for the residual stream and the
        embedding, (batch, heads, queries, keys) for the attention probabilities."""
        k = self.key
        if self.name == "attention":
            heads = self.first_head + torch.arange(x.shape[1], device=x.device)
            queries = k.positions if self.queries is None else self.queries
            keys = k.positions if self.keys is None else self.keys
            coords = (k.rows, heads, queries, keys)
        else:
            positions = k.positions if k.residual_positions is None else k.residual_positions
            coords = (k.rows, positions, torch.arange(x.shape[-1], device=x.device))
        sizes = tuple(len(c) for c in coords)
        if sizes != tuple(x.shape):  # a stale key would silently broadcast or mis-address
            raise ValueError(f"dropout at {self.name} of layer {self.layer}: the key holds "
                             f"coordinates for {sizes}, the activation is {tuple(x.shape)} "
                             "(key each micro-batch's forward with its own rows and positions)")
        return keep_mask(p, (k.seed, k.step, self.layer, SITES[self.name]), coords)


class DropoutKeys:
    """The key in effect for a GPT's dropout sites (``current``; None: torch's generator).
    ``sequence_shard``: (rank, ranks) of sequence parallelism's cut of the residual stream
    (chapter 6 sets it), so ``key`` derives this rank's residual positions."""

    def __init__(self):
        self.current: DropoutKey | None = None
        self.sequence_shard = (0, 1)

    def key(self, seed: int, step: int, rows: torch.Tensor,
            positions: torch.Tensor) -> DropoutKey:
        """The key of a forward on global ``rows`` at ``positions`` (on the model's device)."""
        rank, ranks = self.sequence_shard
        residual = positions.chunk(ranks)[rank] if ranks > 1 else None
        return DropoutKey(seed, step, rows, positions, residual)

    def micro_batches(self, seed: int, step: int, rows: torch.Tensor, m: int,
                      positions: torch.Tensor | None, idx: torch.Tensor) -> list[DropoutKey]:
        """The keys of a step's ``m`` micro-batches: ``rows`` (this rank's global rows, in its
        local batch's order) cut as ``idx.chunk(m)`` cuts the batch; positions 0..s-1 if None."""
        if positions is None:
            positions = torch.arange(idx.shape[1], device=idx.device)
        return [self.key(seed, step, r, positions) for r in rows.to(idx.device).chunk(m)]

    def site(self, layer: int, name: str, first_head: int = 0) -> DropoutSite | None:
        """The site under the current key, or None (no key: torch's generator)."""
        if self.current is None:
            return None
        return DropoutSite(self.current, layer, name, first_head)

    # activation checkpointing replays it (minitrain.checkpointing.forward_states): the key a
    # block's forward used is the key its recompute uses, whatever ran in between
    def get_state(self) -> DropoutKey | None:
        return self.current

    def set_state(self, state: DropoutKey | None) -> None:
        self.current = state


def dropout_site(keys: DropoutKeys | None, layer: int, name: str,
                 first_head: int = 0) -> DropoutSite | None:
    """``keys.site(...)``, or None for a module built without keys (a lone ``Block``)."""
    return None if keys is None else keys.site(layer, name, first_head)
