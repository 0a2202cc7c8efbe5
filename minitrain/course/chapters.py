"""Which library modules each chapter's exercises come from, and where the course lives.

Edit ``CHAPTERS`` when a chapter gains, loses or moves an exercise function: list the
module (the file of its package) whose ``### BEGIN SOLUTION`` functions go into the
chapter's ``exercises/exNN_*.py``, then run ``python -m minitrain.exercises build``.
Read by ``minitrain.course.exercise_regions`` (finding the functions),
``minitrain.course.exercise_files`` (writing the files), ``minitrain.course.patching`` and
``minitrain.course.grade`` (``python -m minitrain.grade``). Kept apart from the code so a
chapter's author finds the table at once.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the course repository

# chapter -> (exercise file stem, modules whose marked functions it contains)
CHAPTERS: dict[int, tuple[str, list[str]]] = {
    0: ("ex00_point_to_point", ["minitrain.runtime.point_to_point"]),
    1: (
        "ex01_single_device",
        ["minitrain.model", "minitrain.data", "minitrain.memory.formulas", "minitrain.step"],
    ),
    2: (
        "ex02_precision",
        [
            "minitrain.precision.formats",
            "minitrain.precision.loss_scaling",
            "minitrain.precision.master_weights",
        ],
    ),
    3: ("ex03_checkpointing", ["minitrain.checkpointing.function", "minitrain.checkpointing.cost"]),
    4: (
        "ex04_collectives_and_ddp",
        ["minitrain.collectives.ring", "minitrain.ddp.bucketing", "minitrain.ddp.data_parallel"],
    ),
    5: (
        "ex05_zero",
        [
            "minitrain.zero.partition",
            "minitrain.zero.optimizer",
            "minitrain.zero.data_parallel",
            "minitrain.fsdp.wrapper",
        ],
    ),
    # later chapters: their authors list the modules (files of their packages) here
    6: (
        "ex06_tensor_parallel",
        [
            "minitrain.tensor_parallel.mappings",
            "minitrain.tensor_parallel.layers",
            "minitrain.tensor_parallel.cross_entropy",
        ],
    ),
    7: (
        "ex07_pipeline_parallel",
        [
            "minitrain.pipeline.schedules",
            "minitrain.pipeline.executor",
            "minitrain.pipeline.check",
        ],
    ),
    8: (
        "ex08_mixture_of_experts",
        ["minitrain.moe.router", "minitrain.moe.dispatch", "minitrain.moe.losses"],
    ),
    9: ("ex09_flash_attention", ["minitrain.flash_attention.tiles"]),
    10: (
        "ex10_context_parallel",
        ["minitrain.context_parallel.merge", "minitrain.context_parallel.ring"],
    ),
    11: ("ex11_putting_it_together", ["minitrain.parallel.mesh", "minitrain.parallel.planner"]),
    12: ("ex12_kernels_and_compilers", ["minitrain.kernels.norms"]),
}
