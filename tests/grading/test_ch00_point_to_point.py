"""Graded tests of chapter 0: point-to-point messages, checked against torch's collectives."""

import pytest
import torch
import torch.distributed as dist

from minitrain.launch import launch


def _token_vs_all_reduce(shape):
    from minitrain.point_to_point import pass_the_token

    token = torch.arange(float(torch.tensor(shape).prod())).reshape(shape)
    before = token.clone()
    mine = pass_the_token(token)
    # Reference: torch's all_reduce of (rank + 1), added to the token.
    ref = torch.tensor(float(dist.get_rank() + 1))
    dist.all_reduce(ref)
    expected_rank0 = before + ref
    # rank r > 0 last held token + 1 + 2 + ... + (r + 1)
    partial = before + sum(range(1, dist.get_rank() + 2))
    return mine, expected_rank0, partial, torch.equal(token, before)


@pytest.mark.exercise("pass_the_token", points=2)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_pass_the_token(world_size):
    results = launch(_token_vs_all_reduce, world_size, (2, 3), timeout=30)
    for rank, (mine, expected_rank0, partial, untouched) in enumerate(results):
        assert untouched, f"rank {rank}: pass_the_token changed its input tensor"
        want = expected_rank0 if rank == 0 else partial
        assert mine.shape == want.shape, (
            f"rank {rank}: returned a tensor of shape {tuple(mine.shape)}, expected {tuple(want.shape)}"
        )
        assert torch.equal(mine, want), (
            f"with {world_size} ranks, rank {rank} returned {mine.flatten()[:3].tolist()}…, "
            f"expected {want.flatten()[:3].tolist()}…"
        )


def _broadcast_vs_torch(src, dtype):
    from minitrain.point_to_point import broadcast

    rank = dist.get_rank()
    mine = torch.full((5,), float(rank * 10 + 1), dtype=dtype)
    ref = mine.clone()
    returned = broadcast(mine, src=src)
    dist.broadcast(ref, src=src)
    return mine, ref, returned is mine


@pytest.mark.exercise("broadcast", points=2)
@pytest.mark.parametrize("world_size,src", [(2, 0), (3, 2), (4, 1)])
def test_broadcast_matches_torch(world_size, src):
    results = launch(_broadcast_vs_torch, world_size, src, torch.float32, timeout=30)
    for rank, (mine, ref, same_object) in enumerate(results):
        assert torch.equal(mine, ref), (
            f"broadcast from rank {src} with {world_size} ranks: rank {rank} holds "
            f"{mine.tolist()}, torch's broadcast gives {ref.tolist()}"
        )
        assert same_object, f"rank {rank}: broadcast must fill the tensor in place and return it"


@pytest.mark.exercise("broadcast", points=1)
def test_broadcast_integer_tensor():
    results = launch(_broadcast_vs_torch, 3, 1, torch.int64, timeout=30)
    for rank, (mine, ref, _) in enumerate(results):
        assert torch.equal(mine, ref), f"int64 broadcast: rank {rank} holds {mine.tolist()}"
