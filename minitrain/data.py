"""Synthetic language-model data: a sparse Markov chain the tiny GPT can learn in seconds.

Used by notebooks/01_single_device_training.ipynb and by every chapter that trains.
No downloads: a seed fixes a random transition table in which every token has only
``branching`` possible successors. A model that learns the table predicts the next token
with loss close to the chain's entropy rate, far below the uniform baseline ln(vocab_size).

Batches are a pure function of (seed, step): ``get_batch(step, batch_size, rank,
world_size)`` generates the *global* batch of that step and returns rank ``rank``'s
contiguous slice, so data-parallel ranks together see exactly the rows one process sees
with the global batch (chapter 4 checks DDP against a single process this way).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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
        pi = torch.full((self.vocab_size,), 1.0 / self.vocab_size, dtype=torch.float64)
        for _ in range(1000):  # power iteration to the stationary distribution
            pi = pi @ P
        logP = torch.where(P > 0, P.log(), torch.zeros_like(P))
        return float(-(pi[:, None] * P * logP).sum())

    def uniform_loss(self) -> float:
        """ln(vocab): the loss of a model that knows nothing (uniform prediction)."""
        return math.log(self.vocab_size)

    def get_batch(
        self, step: int, batch_size: int, rank: int = 0, world_size: int = 1, device=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (batch_size // world_size, seq_len) int64.

        ``batch_size`` is the *global* batch; rank r gets rows [r*B/W, (r+1)*B/W).
        """
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside world_size={world_size}")
        if batch_size < 1 or batch_size % world_size:
            raise ValueError(
                f"global batch_size={batch_size} must be a positive multiple "
                f"of world_size={world_size}"
            )
        tokens = self._sequences(step, batch_size)
        local = batch_size // world_size
        rows = tokens[rank * local : (rank + 1) * local]
        # clones, not views of one (b, s+1) tensor, so each is its own contiguous storage
        x, y = rows[:, :-1].clone(), rows[:, 1:].clone()
        return x.to(device), y.to(device)

    def _sequences(self, step: int, batch_size: int) -> torch.Tensor:
        # Generated on the CPU with its own generator: identical on every device and rank,
        # and independent of the global RNG (model init and dropout do not shift the data).
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        cumulative = self.transitions.cumsum(dim=1)
        out = torch.empty(batch_size, self.seq_len + 1, dtype=torch.long)
        out[:, 0] = torch.randint(self.vocab_size, (batch_size,), generator=gen)
        uniforms = torch.rand(self.seq_len, batch_size, 1, generator=gen, dtype=torch.float64)
        for t in range(self.seq_len):  # sample the next token of every row at once
            rows = cumulative[out[:, t]]
            nxt = torch.searchsorted(rows, uniforms[t], right=True).squeeze(1)
            out[:, t + 1] = nxt.clamp_(max=self.vocab_size - 1)  # guards cumsum rounding
        return out


@lru_cache(maxsize=16)
def _transition_matrix(vocab_size: int, branching: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    P = torch.zeros(vocab_size, vocab_size, dtype=torch.float64)
    for i in range(vocab_size):
        successors = torch.randperm(vocab_size, generator=gen)[:branching]
        weights = torch.rand(branching, generator=gen, dtype=torch.float64) + 0.5
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
