"""Chapter 8 bug hunt —
minitrain.moe.expert_parallel.ExpertParallelMoE.finish_gradient_synchronization (the bug as
it shipped).

Expert parallelism replicates the router on every rank, like data parallelism: its gradient
must be averaged over the expert-parallel group — summed, then divided by its size. MoE
trainers have shipped these gradients reduced with the wrong divisor or not at all
(DeepSpeed's expert gradients divided by the wrong world size, deepspeedai/DeepSpeed#6546; a
missing router all-reduce, pytorch/torchtitan#2416; a wrong router gradient under EP,
huggingface/transformers#48687). The loss is right, so nothing in the run looks off. Here:
summed but not averaged — the ranks agree with each other, and the router learns P times too
fast.

What you see: On 2 ranks, outputs, input gradients and expert gradients equal the local
layer's; the router's gradient is identical on both ranks but exactly twice the local
layer's (4 times on 4 ranks).

Your tools: notebook 08's parity check (expert-parallel layer against the local MoELayer on
the mean of the ranks' losses), the ratio of gradient norms, and the logged collectives.

One line of the function below is wrong or missing. Fix it in
my_exercises/bughunt08_router_gradient.py (run `python -m minitrain.exercises start` once),
then `python -m minitrain.grade 8` re-runs the broken scenario.
"""

# ruff: noqa: F405 (the library module's names come from the star import)
from __future__ import annotations

from minitrain.moe.expert_parallel import *  # noqa: F403 — the module's names, as the library sees them


class ExpertParallelMoE:
    # Only the method with the bug; the rest of the class is in minitrain.moe.expert_parallel.

    def finish_gradient_synchronization(self) -> None:
        """After backward: average the replicated router's gradient over the group, and
        divide the experts' by P (see the module docstring)."""
        for p in self.router.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)
        for p in self.experts.parameters():
            if p.grad is not None:
                p.grad /= self.world

# minitrain-exercises-hash: b5f89fc84c5f4a52
