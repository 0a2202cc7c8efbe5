"""Language-model data: a synthetic Markov chain the tiny GPT learns in seconds, or a text file.

Used by notebooks/01_single_device_training.ipynb and by every chapter that trains;
``TextData`` (a file's bytes) by ``python -m minitrain.train --data FILE`` (chapter 11).
No downloads: a seed fixes a random transition table in which every token has only
``branching`` possible successors. A model that learns the table predicts the next token
with loss close to the chain's entropy rate, far below the uniform baseline ln(vocab_size).

Batches are a pure function of (seed, step): ``get_batch(step, batch_size, rank,
world_size)`` generates the *global* batch of that step and returns rank ``rank``'s
contiguous slice, so data-parallel ranks together see exactly the rows one process sees
with the global batch (chapter 4 checks DDP against a single process this way).
``held_out=True`` gives batch ``step`` of a held-out set instead: for the chain a separate
random stream, for a text file its last 10 %, read in order. Batches are made on the CPU with
their own generator (the global RNG untouched) and then moved to ``device``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch


@dataclass(frozen=True)
class MarkovChainData:
    """A first-order Markov chain over ``vocab_size`` tokens with sparse transitions."""

    vocab_size: int = 64
    seq_len: int = 32
    seed: int = 0
    branching: int = 4  # successors per token

    def __post_init__(self):
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be at least 2, got {self.vocab_size}")
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {self.seq_len}")
        if not 1 <= self.branching <= self.vocab_size:
            raise ValueError(
                f"branching must be in [1, vocab_size={self.vocab_size}], got {self.branching}"
            )

    @property
    def transitions(self) -> torch.Tensor:
        """(vocab, vocab) row-stochastic matrix: P[i, j] = p(next = j | current = i)."""
        return _transition_matrix(self.vocab_size, self.branching, self.seed)

    def entropy_rate(self) -> float:
        """H = -sum_i pi_i sum_j P_ij ln P_ij (nats/token): the best loss any model can reach."""
        P = self.transitions.double()
        pi = torch.full((self.vocab_size,), 1.0 / self.vocab_size, dtype=torch.float64,
                        device=P.device)
        for _ in range(1000):  # power iteration to the stationary distribution
            pi = pi @ P
        logP = torch.where(P > 0, P.log(), torch.zeros_like(P))
        return float(-(pi[:, None] * P * logP).sum())

    def uniform_loss(self) -> float:
        """ln(vocab): the loss of a model that knows nothing (uniform prediction)."""
        return math.log(self.vocab_size)

    def get_batch(
        self, step: int, batch_size: int, rank: int = 0, world_size: int = 1, device=None,
        held_out: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (batch_size // world_size, seq_len) int64.

        ``batch_size`` is the *global* batch; rank r gets rows [r*B/W, (r+1)*B/W).
        ``held_out``: batch ``step`` of the held-out stream (a separate generator seed).
        """
        _check_batch(step, batch_size, rank, world_size)
        tokens = self._sequences(step, batch_size, HELD_OUT_STREAM if held_out else 0)
        return _rows(tokens, batch_size, rank, world_size, device)

    def _sequences(self, step: int, batch_size: int, stream: int = 0) -> torch.Tensor:
        # Generated on the CPU with its own generator: identical on every device and rank,
        # and independent of the global RNG (model init and dropout do not shift the data).
        # Every tensor here names "cpu" (issue 29); the caller moves the rows (``_rows``).
        gen = torch.Generator(device="cpu").manual_seed(self.seed * 1_000_003 + step + stream)
        cumulative = self.transitions.cumsum(dim=1)
        out = torch.empty(batch_size, self.seq_len + 1, dtype=torch.long, device="cpu")
        out[:, 0] = torch.randint(self.vocab_size, (batch_size,), generator=gen, device="cpu")
        uniforms = torch.rand(self.seq_len, batch_size, 1, generator=gen, dtype=torch.float64,
                              device="cpu")
        for t in range(self.seq_len):  # sample the next token of every row at once
            rows = cumulative[out[:, t]]
            nxt = torch.searchsorted(rows, uniforms[t], right=True).squeeze(1)
            out[:, t + 1] = nxt.clamp_(max=self.vocab_size - 1)  # guards cumsum rounding
        return out


HELD_OUT_STREAM = 1 << 31  # added to the generator seed (CPU generators keep 32 bits of it)


def _check_batch(step: int, batch_size: int, rank: int, world_size: int) -> None:
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside world_size={world_size}")
    if batch_size < 1 or batch_size % world_size:
        raise ValueError(
            f"global batch_size={batch_size} must be a positive multiple "
            f"of world_size={world_size}"
        )


def _rows(tokens: torch.Tensor, batch_size: int, rank: int, world_size: int, device):
    """Rank ``rank``'s rows of the global (batch, seq_len + 1) ``tokens``: inputs, targets."""
    local = batch_size // world_size
    rows = tokens[rank * local : (rank + 1) * local]
    # clones, not views of one (b, s+1) tensor, so each is its own contiguous storage
    x, y = rows[:, :-1].clone(), rows[:, 1:].clone()
    return x.to(device), y.to(device)


@dataclass(frozen=True)
class TextData:
    """A text's bytes as tokens (vocabulary 256, no tokenizer to download), the last
    ``held_out`` fraction kept for evaluation.

    Training batch ``step``: ``batch_size`` windows of seq_len + 1 bytes at start offsets drawn
    from the training part by a generator seeded with (seed, step) — nanoGPT's ``get_batch``,
    made a pure function of the step so data-parallel ranks slice one global batch and a
    resumed run reads what it would have read. Held-out batch i: consecutive windows of the
    held-out part (window k = i·batch_size + row starts at k·seq_len, wrapping around), the
    same fixed set every time.
    """

    tokens: torch.Tensor = field(repr=False)  # int64 on the CPU, one per byte
    seq_len: int = 32
    seed: int = 0
    held_out: float = 0.1
    name: str = "<bytes>"
    vocab_size: int = 256

    @classmethod
    def from_file(cls, path: str, seq_len: int, seed: int = 0, held_out: float = 0.1):
        """Read ``path``'s bytes; a missing, empty or too-short file is a ValueError naming it."""
        try:
            with open(path, "rb") as fh:
                raw = fh.read()
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
        return cls.from_bytes(raw, seq_len, seed, held_out, name=path)

    @classmethod
    def from_bytes(cls, raw: bytes, seq_len: int, seed: int = 0, held_out: float = 0.1,
                   name: str = "<bytes>"):
        # a bytearray copy: torch.frombuffer wants a writable buffer it may share
        tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.long) \
            if raw else torch.zeros(0, dtype=torch.long, device="cpu")
        return cls(tokens, seq_len, seed, held_out, name)

    def __post_init__(self):
        n, need = len(self.tokens), self.seq_len + 1
        if not 0 < self.held_out < 1:
            raise ValueError(f"held_out must be in (0, 1), got {self.held_out}")
        if n == 0:
            raise ValueError(f"{self.name} is empty")
        if min(self.split, n - self.split) < need:
            raise ValueError(
                f"{self.name} has {n} bytes: too short — its training part ({self.split} bytes) "
                f"and its last {self.held_out:.0%} (held out, {n - self.split} bytes) must each "
                f"hold one window of seq_len + 1 = {need} bytes")

    @property
    def split(self) -> int:
        """Where the held-out part starts: the last ``held_out`` fraction of the bytes."""
        return len(self.tokens) - int(len(self.tokens) * self.held_out)

    def get_batch(
        self, step: int, batch_size: int, rank: int = 0, world_size: int = 1, device=None,
        held_out: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``MarkovChainData.get_batch``: rank ``rank``'s rows of global batch ``step``."""
        _check_batch(step, batch_size, rank, world_size)
        window = self.seq_len + 1
        if held_out:
            part = self.tokens[self.split:]
            first = (step * batch_size + torch.arange(batch_size, device="cpu")) * self.seq_len
            starts = first % (len(part) - window + 1)
        else:
            part = self.tokens[: self.split]
            gen = torch.Generator(device="cpu").manual_seed(self.seed * 1_000_003 + step)
            starts = torch.randint(len(part) - window + 1, (batch_size,), generator=gen,
                                   device="cpu")
        tokens = part[starts[:, None] + torch.arange(window, device="cpu")]
        return _rows(tokens, batch_size, rank, world_size, device)


@lru_cache(maxsize=16)
def _transition_matrix(vocab_size: int, branching: int, seed: int) -> torch.Tensor:
    # on the CPU with a CPU generator: the same chain on every device (issue 29)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    P = torch.zeros(vocab_size, vocab_size, dtype=torch.float64, device="cpu")
    for i in range(vocab_size):
        successors = torch.randperm(vocab_size, generator=gen, device="cpu")[:branching]
        weights = torch.rand(branching, generator=gen, dtype=torch.float64, device="cpu") + 0.5
        P[i, successors] = weights / weights.sum()
    return P


def get_batch(
    step: int,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    *,
    vocab_size: int = 64,
    seq_len: int = 32,
    seed: int = 0,
    branching: int = 4,
    device=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``MarkovChainData(vocab_size, seq_len, seed, branching).get_batch(...)``."""
    data = MarkovChainData(vocab_size, seq_len, seed, branching)
    return data.get_batch(step, batch_size, rank, world_size, device=device)
