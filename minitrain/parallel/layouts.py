"""Which layouts there are: ``Layout``, one way to run, and every way the chapters can run.

Chapter 11, notebooks/11_putting_it_together.ipynb (and its widget); ``planner.plan`` ranks
what ``enumerate_layouts`` returns. A layout is DP × TP × PP × CP (× EP inside DP × CP), a ZeRO
stage, activation checkpointing, micro-batches and a pipeline schedule, sequence parallelism;
``enumerate_layouts`` keeps those the course's techniques compose (the rules of
``minitrain.parallel.parallelize.check_composition`` and ``check_moe_composition``), each of
which builds and trains in ``minitrain.parallel.ParallelGPT`` (``layout_dict``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from minitrain.model import GPTConfig


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: int = 0
    checkpointing: str = "none"  # or "full" (chapter 3)
    microbatches: int = 1  # per step; with pp = 1, gradient-accumulation steps
    schedule: str = "1f1b"
    sequence_parallel: bool = False
    ep: int = 1  # expert parallelism, inside dp × cp (chapter 8)

    def __str__(self):
        sp = "+SP" if self.sequence_parallel else ""
        ck = ", recompute" if self.checkpointing == "full" else ""
        ep = f"×EP{self.ep}" if self.ep > 1 else ""
        return (f"DP{self.dp}×TP{self.tp}{sp}×PP{self.pp}×CP{self.cp}{ep}, ZeRO-{self.zero}, "
                f"m={self.microbatches} {self.schedule}{ck}")


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def enumerate_layouts(config: GPTConfig, seq_len: int, global_batch: int, devices: int,
                      devices_per_node: int, zero_stages=(0, 1, 2, 3),
                      checkpointing=("none", "full"), max_cp: int = 16) -> list[Layout]:
    """Every layout the course's techniques can run: TP inside a node dividing the heads, PP
    up to the layers, CP dividing the sequence, micro-batch counts dividing the local batch.
    Sequence parallelism with every tp > 1 whose ranks divide a CP rank's positions (with
    CP, SP cuts each CP shard further over the TP ranks, as Megatron-Core does). Each one
    builds and trains in ``minitrain.parallel.ParallelGPT`` (``layout_dict``)."""
    out = []
    for tp in _divisors(devices, devices_per_node):
        if config.n_head % tp or config.d_ff % tp or config.vocab_size % tp:
            continue
        # a tied head lives with the embedding on the first stage: no pipeline (chapter 7)
        for pp in _divisors(devices // tp, 1 if config.tie_weights else config.n_layer):
            for cp in _divisors(devices // (tp * pp), max_cp):
                if seq_len % (2 * cp if cp > 1 else 1):
                    continue
                sp = tp > 1 and (seq_len // cp) % tp == 0 and not config.moe_experts
                dp = devices // (tp * pp * cp)
                if global_batch % dp:
                    continue
                local = global_batch // dp
                counts = [m for m in _divisors(local, local) if pp == 1 or m >= pp]
                for m in counts:
                    for zero in zero_stages:
                        if zero > 1 and pp > 1:  # not combined (see parallelize.check_composition)
                            continue
                        for ck in checkpointing:
                            out += [Layout(dp, tp, pp, cp, zero, ck, m, "1f1b", sp, ep)
                                    for ep in _expert_parallel_sizes(config, dp * cp, pp, zero)]
    return out


def _expert_parallel_sizes(config: GPTConfig, replicas: int, pp: int, zero: int) -> list[int]:
    """ep sizes dividing dp × cp and the experts; MoE runs with pp = 1, ep > 1 with ZeRO-0
    (and no SP; ``parallelize.check_moe_composition``), a dense model with ep = 1."""
    if not config.moe_experts or zero > 0:
        return [] if pp > 1 and config.moe_experts else [1]
    if pp > 1:
        return []
    return [ep for ep in _divisors(replicas, replicas) if config.moe_experts % ep == 0]


def layout_dict(layout: Layout) -> dict:
    return asdict(layout)
