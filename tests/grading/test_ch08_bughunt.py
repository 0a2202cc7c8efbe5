"""Chapter 8 bug hunt (minitrain.course.bughunts): the replicated router's gradient under
expert parallelism. Reference: the local MoELayer on one process, fed every rank's tokens, with
the loss the mean of the ranks' losses (as tests/test_moe.py does); every gradient of the
expert-parallel layer on 2 ranks must equal its share of the local layer's."""

import pytest
import torch
import torch.distributed as dist

from minitrain.runtime import get_device, launch

E, K, T, D = 4, 2, 12, 8


def _tokens(seed):
    """T tokens of width D where an MoE layer built without ``device=`` lives, ``get_device()``:
    drawn on the CPU (the same numbers on every device), then moved there (issue 41)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(T, D, generator=gen, device="cpu").to(get_device())


def _against_the_local_layer():
    from minitrain.moe import ExpertParallelMoE, MoELayer

    rank, P = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    local = MoELayer(D, 16, E, top_k=K)
    xs = [_tokens(10 + r) for r in range(P)]
    ws = [_tokens(20 + r) for r in range(P)]
    ep = ExpertParallelMoE.from_local(local)
    total = sum(((local(xs[r]) * ws[r]).sum() + local.aux_loss) / P for r in range(P))
    total.backward()
    y = ep(xs[rank])
    ((y * ws[rank]).sum() + ep.aux_loss).backward()
    ep.finish_gradient_synchronization()
    per = E // P
    router = {n: (q.grad, dict(local.router.named_parameters())[n].grad)
              for n, q in ep.router.named_parameters() if q.grad is not None}
    experts = {n: (q.grad, dict(local.experts.named_parameters())[n].grad[rank * per:(rank + 1) * per])
               for n, q in ep.experts.named_parameters()}
    return {f"{part}.{n}": (float((a - b).abs().max()), float(a.norm() / b.norm()))
            for part, grads in (("router", router), ("experts", experts)) for n, (a, b) in grads.items()}


@pytest.mark.exercise("bug hunt: ExpertParallelMoE.finish_gradient_synchronization", points=2)
def test_expert_parallel_gradients_equal_the_local_layers():
    for rank, grads in enumerate(launch(_against_the_local_layer, 2, timeout=90)):
        assert grads, f"rank {rank}: no gradients were compared"
        for name, (diff, ratio) in grads.items():
            assert diff < 1e-5, (
                f"rank {rank}: the gradient of {name} differs from the local layer's by {diff:.3g}; "
                f"its norm is {ratio:.3f} times the local layer's (1 is right; 2 on 2 ranks means "
                "summed over the ranks but not averaged)")
