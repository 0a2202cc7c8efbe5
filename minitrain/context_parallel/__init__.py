"""Context parallelism (chapter 10): ring attention over a sequence split across ranks.

Liu et al. 2023 ("Ring Attention with Blockwise Transformers"). Files by role:
``layout.py`` (which chunks of the sequence each rank holds: contiguous or zigzag;
``shard_sequence``/``gather_sequence``), ``merge.py`` (partial attention merged by its
logsumexp), ``ring.py`` (the ring: forward, backward, the autograd Function; each block by
chapter 9's ``flash_attention_forward``/``flash_attention_backward``), ``model.py`` (the course's GPT trained with its
sequence split), ``gathered.py`` (K and V all-gathered, for keyed attention dropout, chapter
11; ``cp_bytes_per_rank``: its bytes and memory beside the ring's) and ``measure.py`` (bytes,
FLOPs, time and memory per rank).
"""

from minitrain.context_parallel.gathered import cp_bytes_per_rank
from minitrain.context_parallel.layout import (
    gather_sequence,
    rank_chunks,
    shard_positions,
    shard_sequence,
)
from minitrain.context_parallel.merge import merge_attention
from minitrain.context_parallel.model import ContextParallelGPT
from minitrain.context_parallel.ring import (
    RingAttentionFunction,
    communication_log,
    reset_communication_log,
    ring_attention,
)

__all__ = [
    "ContextParallelGPT",
    "RingAttentionFunction",
    "communication_log",
    "cp_bytes_per_rank",
    "gather_sequence",
    "merge_attention",
    "rank_chunks",
    "reset_communication_log",
    "ring_attention",
    "shard_positions",
    "shard_sequence",
]
