"""Unit tests of minitrain.data: determinism, data-parallel sharding, learnable structure."""

import math

import pytest
import torch

from minitrain.data import MarkovChainData, get_batch
from minitrain.model import GPT, GPTConfig


def test_same_step_same_batch_other_step_other_batch():
    x1, y1 = get_batch(3, 8)
    x2, y2 = get_batch(3, 8)
    x3, _ = get_batch(4, 8)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, x3)
    assert x1.shape == y1.shape == (8, 32) and x1.dtype == torch.long


def test_targets_are_inputs_shifted_by_one():
    x, y = get_batch(0, 4, seq_len=10)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert x.is_contiguous() and y.is_contiguous()
    assert x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_together_see_the_global_batch(world_size):
    gx, gy = get_batch(7, 8)
    parts = [get_batch(7, 8, rank=r, world_size=world_size) for r in range(world_size)]
    assert all(p[0].shape[0] == 8 // world_size for p in parts)
    assert torch.equal(torch.cat([p[0] for p in parts]), gx)
    assert torch.equal(torch.cat([p[1] for p in parts]), gy)


def test_sequences_follow_the_sparse_transitions():
    data = MarkovChainData(vocab_size=32, seq_len=20, seed=3, branching=3)
    P = data.transitions
    assert torch.allclose(P.sum(1), torch.ones(32, dtype=P.dtype))
    assert ((P > 0).sum(1) == 3).all()
    x, y = data.get_batch(0, 64)
    assert (P[x.flatten(), y.flatten()] > 0).all()


def test_entropy_rate_matches_empirical_conditional_entropy():
    data = MarkovChainData(vocab_size=16, seq_len=64, seed=1, branching=3)
    counts = torch.zeros(16, 16, dtype=torch.float64)
    for step in range(10):
        x, y = data.get_batch(step, 256)
        counts.index_put_(
            (x.flatten(), y.flatten()), torch.ones(x.numel(), dtype=torch.float64), accumulate=True
        )
    joint = counts / counts.sum()
    cond = counts / counts.sum(1, keepdim=True)
    empirical = -(joint[counts > 0] * cond[counts > 0].log()).sum().item()
    assert abs(empirical - data.entropy_rate()) < 0.02
    assert data.entropy_rate() < data.uniform_loss() == math.log(16)


@pytest.mark.parametrize(
    "kwargs,word",
    [
        ({"batch_size": 6, "world_size": 4}, "world_size=4"),
        ({"rank": 2, "world_size": 2}, "rank=2"),
        ({"step": -1}, "step"),
    ],
)
def test_bad_arguments_name_the_value(kwargs, word):
    args = {"step": 0, "batch_size": 8} | kwargs
    with pytest.raises(ValueError, match=word):
        get_batch(**args)


def test_tiny_gpt_learns_the_chain_well_below_uniform():
    torch.manual_seed(0)
    data = MarkovChainData()
    model = GPT(GPTConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(150):
        x, y = data.get_batch(step, 32)
        loss = model.loss(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    x, y = data.get_batch(10_000, 256)
    with torch.no_grad():
        final = model.loss(x, y).item()
    # uniform: ln 64 = 4.16; the chain's entropy rate is the floor
    assert final < data.uniform_loss() - 2.0
    assert final > data.entropy_rate() - 0.05
