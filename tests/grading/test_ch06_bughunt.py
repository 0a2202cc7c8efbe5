"""Chapter 6 bug hunt (minitrain.course.bughunts): sequence parallelism's LayerNorms. Every
gradient of the tensor+sequence-parallel GPT against the dense model's (each rank's shard of
it), as tests/test_tensor_parallel.py does; the LayerNorm gains are where this bug shows."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minitrain.model import GPT, GPTConfig
from minitrain.runtime import launch

CONFIG = dict(vocab_size=64, seq_len=16, n_layer=1, n_head=4, d_model=32)
ATOL, RTOL = 1e-6, 1e-5  # fp32, only the order of sums differs (see test_tensor_parallel.py)


def _shard_of(full, like, rank, world):
    for d in range(full.dim()):
        if full.shape[d] != like.shape[d]:
            return full.chunk(world, d)[rank]
    return full


def _gradients_against_dense():
    from minitrain.tensor_parallel import apply_tensor_parallel

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    dense = GPT(GPTConfig(**CONFIG))
    tp = apply_tensor_parallel(copy.deepcopy(dense), sequence_parallel=True)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 64, (2, 16), generator=g) for _ in range(2))
    F.cross_entropy(dense(x).reshape(-1, 64), y.reshape(-1)).backward()
    tp.loss(x, y).backward()
    dense_params = dict(dense.named_parameters())
    bad, sums_match = {}, []
    for name, p in tp.named_parameters():
        want = _shard_of(dense_params[name].grad, p, rank, world)
        if ((p.grad - want).abs() > ATOL + RTOL * want.abs()).any():
            bad[name] = (p.grad - want).abs().max().item()
        if p.shape == dense_params[name].shape:  # replicated: would the ranks' sum match?
            summed = p.grad.clone()
            dist.all_reduce(summed)  # every rank, every replicated parameter, in one order
            if name in bad and torch.allclose(summed, want, atol=ATOL, rtol=RTOL):
                sums_match.append(name)
    return bad, sums_match


@pytest.mark.exercise("bug hunt: SequenceParallelLayerNorm.forward", points=2)
def test_every_gradient_matches_the_dense_model_under_sequence_parallelism():
    for rank, (bad, sums_match) in enumerate(launch(_gradients_against_dense, 2, timeout=120)):
        listed = ", ".join(f"{name} (off by {diff:.3g})" for name, diff in bad.items())
        summed = (
            f"; summed over the 2 ranks, {'all' if len(sums_match) == len(bad) else len(sums_match)}"
            " of them would equal the dense gradient"
            if sums_match else ""
        )
        assert not bad, (
            f"rank {rank}: with sequence parallelism, {len(bad)} gradient(s) differ from the "
            f"dense model's: {listed}; every other gradient matches{summed}"
        )
