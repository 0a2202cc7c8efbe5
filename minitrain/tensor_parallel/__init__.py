"""Tensor parallelism (chapter 6): Megatron-LM's split of a transformer's matrices.

Shoeybi et al. 2019 ("Megatron-LM", section 3, Figure 3) and, for sequence parallelism
and activation memory, Korthikanti et al. 2022 (sections 4 and 4.2.2). Files by role:
``mappings.py`` (the conjugate operators f and g and their relatives), ``layers.py``
(column/row-parallel Linears, the vocab-parallel embedding), ``cross_entropy.py``,
``random.py`` (dropout streams), ``apply.py`` (the GPT made tensor-parallel) and
``measure.py`` (bytes and activation memory, counted against the formulas).
"""

from minitrain.tensor_parallel.apply import apply_tensor_parallel
from minitrain.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from minitrain.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from minitrain.tensor_parallel.mappings import (
    communication_log,
    copy_to_parallel_region,
    gather_from_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    reset_communication_log,
    scatter_to_parallel_region,
    scatter_to_sequence_parallel_region,
)
from minitrain.tensor_parallel.random import TensorParallelRNG

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelRNG",
    "VocabParallelEmbedding",
    "apply_tensor_parallel",
    "communication_log",
    "copy_to_parallel_region",
    "gather_from_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_from_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "reset_communication_log",
    "scatter_to_parallel_region",
    "scatter_to_sequence_parallel_region",
    "vocab_parallel_cross_entropy",
]
