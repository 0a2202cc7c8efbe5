"""Chapter 11 — putting it together: the techniques composed on a device mesh, a planner, one command.

Used by notebooks/11_putting_it_together.ipynb and ``python -m minitrain.train``. Files by role:

- ``mesh.py``: ``DeviceMesh``, the ranks as a PP × DP × CP × TP grid and one group per line
  (``rank_coords``, ``axis_groups``: chapter 11's exercises), ``check_layout``;
- ``parallelize.py``: ``parallelize(model, mesh, layout)``, the composition as a sequence of
  ``apply_tensor_parallel``, ``apply_context_parallel``, ``apply_pipeline``,
  ``apply_data_parallel``, each over its mesh group (torchtitan's way); ``full_layout``;
- ``trainer.py``: ``ParallelGPT``, the trainer (batching, micro-batches, the step, the loss
  averaged over the replicas, ``state()`` / ``load_state()``); ``reference.py``:
  ``single_process_losses``, the one-process curve every layout is compared with;
- ``planner.py``: memory and step time of every layout from the chapters' formulas, ``plan``
  (``params_per_rank`` is an exercise); ``layouts.py``: ``Layout``, ``enumerate_layouts``;
- ``published_layouts.py``: Megatron-LM 2021 and Llama 3 405B, to hold the planner against;
- ``run_checkpoint.py``: a run's sharded, atomic checkpoints (``save_run``, ``load_run``) —
  not chapter 3's activation checkpointing;
- ``command.py``: the body of ``python -m minitrain.train`` (parser, ``train_rank``, ``main``);
  ``command_flags.py`` its flags, their checks and what they mean (config, layout, schedule);
  ``command_errors.py`` its one-line failures.
"""

from minitrain.parallel.command import CPU_PEAK_FLOPS, build_parser, train_rank
from minitrain.parallel.mesh import (
    AXES,
    DeviceMesh,
    MeshCoords,
    axis_groups,
    check_layout,
    rank_coords,
)
from minitrain.parallel.parallelize import (
    OPTIMIZERS,
    Parallelized,
    apply_context_parallel,
    apply_data_parallel,
    apply_pipeline,
    check_composition,
    full_layout,
    parallelize,
)
from minitrain.parallel.planner import (
    BYTES_PER_ELEMENT,
    Cluster,
    Layout,
    activation_bytes,
    enumerate_layouts,
    in_flight,
    layout_dict,
    memory_per_device,
    params_per_rank,
    plan,
    step_time,
)
from minitrain.parallel.published_layouts import (
    MEGATRON_2021,
    a100_cluster,
    h100_cluster,
    published_cases,
)
from minitrain.parallel.reference import single_process_losses
from minitrain.parallel.run_checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_run,
    save_run,
)
from minitrain.parallel.trainer import ParallelGPT

__all__ = [
    "AXES",
    "BYTES_PER_ELEMENT",
    "CPU_PEAK_FLOPS",
    "CheckpointError",
    "Cluster",
    "DeviceMesh",
    "Layout",
    "MEGATRON_2021",
    "MeshCoords",
    "OPTIMIZERS",
    "ParallelGPT",
    "Parallelized",
    "a100_cluster",
    "activation_bytes",
    "apply_context_parallel",
    "apply_data_parallel",
    "apply_pipeline",
    "axis_groups",
    "build_parser",
    "check_composition",
    "check_layout",
    "enumerate_layouts",
    "full_layout",
    "h100_cluster",
    "in_flight",
    "latest_checkpoint",
    "layout_dict",
    "load_run",
    "memory_per_device",
    "params_per_rank",
    "parallelize",
    "plan",
    "published_cases",
    "rank_coords",
    "save_run",
    "single_process_losses",
    "step_time",
    "train_rank",
]
