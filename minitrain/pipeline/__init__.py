"""Pipeline parallelism (chapter 7): the model cut into stages, micro-batches flowing through.

GPipe (Huang et al. 2019), 1F1B / PipeDream-Flush and interleaved 1F1B (Narayanan et al.
2021, section 2.2), zero-bubble ZB-H1 (Qi et al. 2024). Files by role: ``schedules.py``
(schedules as pure data), ``check.py`` (validate and simulate a schedule: deadlock, makespan,
bubble, peak in-flight micro-batches), ``executor.py`` (``PipelineStage``: run any schedule
over send/recv), ``step_messages.py`` (what a step sends once: the loss to every stage, the
gradients averaged over data parallelism), ``partition.py`` (the GPT cut into stages),
``measure.py`` (bubbles and activation memory measured against formulas).
Used by notebooks/07_pipeline_parallel.ipynb.
"""

from minitrain.pipeline.check import (
    UNIT,
    ScheduleError,
    Simulation,
    bubble_fraction,
    chunk_costs,
    dependencies,
    interleaved_bubble_fraction,
    interleaved_peak_in_flight,
    one_f_one_b_bubble_fraction,
    simulate,
    validate,
    zero_bubble_h1_makespan,
)
from minitrain.pipeline.executor import PipelineStage, StepState, run_action
from minitrain.pipeline.partition import StageChunk, split_blocks
from minitrain.pipeline.schedules import (
    SCHEDULES,
    gpipe_schedule,
    interleaved_one_f_one_b_schedule,
    make_schedule,
    one_f_one_b_schedule,
    resolve_schedule,
    zero_bubble_schedule,
)
from minitrain.pipeline.step_messages import average_gradients

__all__ = [
    "PipelineStage",
    "StageChunk",
    "StepState",
    "average_gradients",
    "run_action",
    "split_blocks",
    "SCHEDULES",
    "UNIT",
    "ScheduleError",
    "Simulation",
    "bubble_fraction",
    "chunk_costs",
    "dependencies",
    "gpipe_schedule",
    "interleaved_bubble_fraction",
    "interleaved_peak_in_flight",
    "interleaved_one_f_one_b_schedule",
    "make_schedule",
    "one_f_one_b_bubble_fraction",
    "one_f_one_b_schedule",
    "resolve_schedule",
    "simulate",
    "validate",
    "zero_bubble_h1_makespan",
    "zero_bubble_schedule",
]
