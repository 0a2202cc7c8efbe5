"""Chapter 7 bug hunt — minitrain.pipeline.schedules.interleaved_one_f_one_b_schedule (the fix,
as the library has it).

Interleaved 1F1B gives stage s a warm-up of 2(p - s - 1) + (v - 1)·g forwards before it
alternates; with few micro-batches that count can exceed the m·v forwards the stage has at
all, and it must be capped at that total. PyTorch's PiPPy shipped interleaved 1F1B without
the cap (fixed by adding a min: pytorch/PiPPy#1081, 2024); torchtitan users saw pipelines
hang with fewer micro-batches than stages (pytorch/torchtitan#775); AMD's Primus 1F1B
schedulers crashed for the missing clamp (AMD-AGI/Primus#1003). Few micro-batches is the
case nobody benchmarks.

What you see: On 2 ranks with 3 chunks each, m = 2 trains like one process, but m = 1 does
not run: every rank stops before the first action with a ScheduleError (this executor checks
a schedule before running it; one without the check waits forever on a receive).

Your tools: notebook 07's schedule checker (`simulate`, and `plot_schedule` to see each
stage's actions): count each stage's F and B per (micro-batch, chunk); parity of
`PipelineStage.train_step` with one process.

One line of the function below is wrong or missing. Fix it in
my_exercises/bughunt07_interleaved_warmup.py (run `python -m minitrain.exercises start`
once), then `python -m minitrain.grade 7` re-runs the broken scenario.
"""

# ruff: noqa: F405 (the library module's names come from the star import)
from __future__ import annotations

from minitrain.pipeline.schedules import *  # noqa: F403 — the module's names, as the library sees them


def interleaved_one_f_one_b_schedule(
    num_stages: int, num_microbatches: int, num_chunks: int
) -> list[list[tuple]]:
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2, Figure 4, bottom).

    Each stage holds ``v = num_chunks`` model chunks; chunk c of stage s is virtual stage
    c*p + s. Micro-batches go through in groups of p: a stage runs the forwards of one group
    on chunk 0, then on chunk 1, ... (backwards in the reverse chunk order). Stage s starts
    with ``2(p - s - 1) + (v - 1) * g`` warm-up forwards (g = min(p, m), the group size;
    Megatron-LM's count), then alternates, then drains. Each chunk's forward costs 1/v of
    a stage's, so under unit stage costs the bubble shrinks to (p-1)/(v*m + p-1) when p
    divides m (``check.interleaved_bubble_fraction`` derives it), at the price of more
    activations: stage s holds up to min(2(p-s-1) + (v-1)p + 1, v*m) chunks, each 1/v of
    the stage (``check.interleaved_peak_in_flight``). v = 1 is plain 1F1B.
    """
    check_sizes(num_stages, num_microbatches, num_chunks)
    p, m, v = num_stages, num_microbatches, num_chunks
    g = min(p, m)

    def order(reverse_chunks: bool) -> list[tuple[int, int]]:
        out = []
        for start in range(0, m, g):  # groups of g micro-batches
            group = range(start, min(start + g, m))
            for c in (reversed(range(v)) if reverse_chunks else range(v)):
                out += [(mb, c) for mb in group]
        return out

    forwards, backwards = order(False), order(True)

    def build(extra: int) -> list[list[tuple]]:
        schedule = []
        for s in range(p):
            if v == 1:  # plain 1F1B
                warmup = p - s - 1
            else:
                warmup = 2 * (p - s - 1) + (v - 1) * g + extra
            warmup = min(warmup, m * v)
            actions = [("F", *a) for a in forwards[:warmup]]
            for i in range(m * v - warmup):
                actions += [("F", *forwards[warmup + i]), ("B", *backwards[i])]
            actions += [("B", *b) for b in backwards[m * v - warmup:]]
            schedule.append(actions)
        return schedule

    # When p does not divide m, Megatron-LM's warm-up can leave the last partial group
    # waiting on a backward that waits on it (e.g. p=4, m=5, v=3): add warm-up forwards
    # until it runs. With every forward first (GPipe's order) it always runs.
    for extra in range(m * v + 1):
        schedule = build(extra)
        try:
            simulate(schedule, num_microbatches=m, num_chunks=v)
            return schedule
        except ScheduleError:
            continue
    return schedule  # unreachable: extra = m*v is the all-forwards-first order

# minitrain-exercises-hash: a35290a5eb7a61c2
