"""Chapter 6 bug hunt — minitrain.tensor_parallel.apply.SequenceParallelLayerNorm.forward (the
fix, as the library has it).

Sequence parallelism splits the LayerNorms' tokens over the tensor-parallel ranks, so each
rank's LayerNorm-gain gradient covers only its tokens and must be summed over the group.
Megatron-style trainers have shipped sequence parallelism with these gradients left
unsummed: every rank updates a different LayerNorm.

What you see: Loss and most gradients match the dense model; the LayerNorm gains' gradients
differ between tensor-parallel ranks and from the dense model's, by about one rank's share.

Your tools: notebook 06's parity check: every gradient of the tensor-parallel GPT against
the dense model (gather each rank's shards), and the logged collectives (mappings).

One line of the function below is wrong or missing. Fix it in
my_exercises/bughunt06_sequence_parallel_norm.py (run `python -m minitrain.exercises start`
once), then `python -m minitrain.grade 6` re-runs the broken scenario.
"""

# ruff: noqa: F405 (the library module's names come from the star import)
from __future__ import annotations

from minitrain.tensor_parallel.apply import *  # noqa: F403 — the module's names, as the library sees them


class SequenceParallelLayerNorm:
    # Only the method with the bug; the rest of the class is in minitrain.tensor_parallel.apply.

    def forward(self, x):
        weight = copy_to_parallel_region(self.weight, self.group)
        bias = None if self.bias is None else copy_to_parallel_region(self.bias, self.group)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)

# minitrain-exercises-hash: d6ffaf2a59c2a6ed
