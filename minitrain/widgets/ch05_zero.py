"""Widget of notebook 05: a ZeRO memory calculator, and stage 3's gather/compute/free timeline.

Used by notebooks/05_zero.ipynb. ``compute_zero_memory`` is the pure function behind the
calculator (unit tested): for a model of ``num_params`` parameters on ``world_size`` ranks it
gives each rank's bytes for parameters, gradients and optimizer state under plain data
parallelism and ZeRO stages 1-3 (Rajbhandari et al. 2020, §5 and Figure 1), in fp32 or the paper's
mixed precision (K = 12), with or without optimizer offload. The bars are drawn per
parameter (bytes/parameter per rank), so the points measured in the notebook on a small model
(``measured``) sit on the same axis as a trillion-parameter model's formula.

``compute_fsdp`` is the pure function behind the FSDP line (``minitrain.fsdp``, Zhao et al.
2023): ZeRO-3's sharding with an external optimizer, its bytes per rank and bytes sent per
step for a ``compute_dtype`` of fp32, bf16 or fp16 (gathers and compute in that dtype; shards'
gradients and optimizer in fp32), next to plain data parallelism's.
"""

from __future__ import annotations

import torch

from minitrain.fsdp.measure import fsdp_formula
from minitrain.widgets import live, plot_png
from minitrain.zero import communication_formula, memory_formula

STAGES = ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
PARTS = ("params", "grads", "optimizer")
COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868"}
# the parameter counts the calculator offers (well-known model sizes)
MODEL_SIZES = [
    ("125M", 125e6), ("1.3B", 1.3e9), ("7.5B", 7.5e9), ("13B", 13e9), ("70B", 70e9),
    ("175B", 175e9), ("405B", 405e9), ("1T", 1e12),
]


def compute_zero_memory(
    num_params: int,
    world_size: int,
    stage: int,
    precision: str = "fp32",
    offload: bool = False,
    measured: list | None = None,
) -> dict:
    """Per-rank model-state memory for every stage, and the selected one.

    Returns {"stages": [memory_formula(...) for DP, 1, 2, 3], "selected": that of ``stage``,
    "per_param": [total/Ψ per stage], "saving": DP total / selected total, "points": the
    measured runs (dicts with stage, world_size, params, grads, optimizer, num_params) that
    match ``world_size`` and fp32 without offload, as (stage, bytes per parameter)}.
    """
    if num_params <= 0:
        raise ValueError(f"num_params must be positive, got {num_params!r}")
    # offload is a ZeRO feature (ZeRO-Offload shards then offloads): plain DP keeps its state
    stages = [
        memory_formula(num_params, world_size, s, precision, offload and s >= 1) for s in range(4)
    ]
    selected = stages[stage]
    points = []
    if precision == "fp32" and not offload:
        for m in measured or []:
            if m["world_size"] == world_size:
                total = sum(m[p] for p in PARTS)
                points.append((m["stage"], total / m["num_params"]))
    return {
        "stages": stages,
        "selected": selected,
        "stage": stage,
        "per_param": [s["total"] / num_params for s in stages],
        "saving": stages[0]["total"] / selected["total"] if selected["total"] else float("inf"),
        "points": points,
        "num_params": num_params,
        "world_size": world_size,
        "offload": offload,
    }


COMPUTE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_fsdp(num_params: int, world_size: int, compute_dtype: str = "fp32") -> dict:
    """FSDP's bytes per rank (params, grads, optimizer, total) and bytes sent per step
    ("sent"), with DP's fp32 totals for comparison ("dp_total", "dp_sent"), for Ψ =
    ``num_params`` on ``world_size`` ranks with AdamW (``minitrain.fsdp.measure.fsdp_formula``)."""
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be one of {list(COMPUTE_DTYPES)}, got {compute_dtype!r}")
    if num_params <= 0:
        raise ValueError(f"num_params must be positive, got {num_params!r}")
    out = fsdp_formula(num_params, world_size, COMPUTE_DTYPES[compute_dtype])
    return {
        **out,
        "compute_dtype": compute_dtype,
        "num_params": num_params,
        "world_size": world_size,
        "dp_total": memory_formula(num_params, world_size, 0)["total"],
        "dp_sent": communication_formula(num_params, world_size, 0),
    }


def describe_fsdp(view: dict) -> str:
    n = view["num_params"]
    return (
        f"FSDP ({view['compute_dtype']} gathers and compute) on {view['world_size']} ranks: "
        f"<b>{view['total'] / n:.3g} bytes/parameter</b> per rank ({_bytes(view['total'])}; "
        f"DP fp32 {_bytes(view['dp_total'])}), <b>{_bytes(view['sent'])} sent per step</b> "
        f"per rank ({view['sent'] / view['dp_sent']:.3g}× DP's all-reduce)"
    )


def _bytes(x: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.0f} B"


def describe(view: dict) -> str:
    s = view["selected"]
    parts = " + ".join(f"{s[p] / view['num_params']:.3g}" for p in PARTS)
    host = f"; {_bytes(s['host'])} on the host" if s["host"] else ""
    if view.get("offload") and view["stage"] == 0:
        host = "; offload applies to ZeRO stages only"
    return (
        f"{STAGES[view['stage']]} on {view['world_size']} ranks: {parts} = "
        f"<b>{view['per_param'][view['stage']]:.3g} bytes/parameter</b> per rank, "
        f"<b>{_bytes(s['total'])}</b> per rank for {view['num_params']:.3g} parameters{host} "
        f"(DP: {_bytes(view['stages'][0]['total'])}; {view['saving']:.3g}× less)"
    )


def plot_memory(view: dict, ax=None):
    """Stacked bars (bytes per parameter, per rank) for DP and stages 1-3; measured points."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 3.2))
    n = view["num_params"]
    for x, stage in enumerate(view["stages"]):
        bottom, alpha = 0.0, 1.0 if x == view["stage"] else 0.35
        for part in PARTS:
            height = stage[part] / n
            ax.bar(
                x,
                height,
                bottom=bottom,
                color=COLORS[part],
                alpha=alpha,
                label=part if x == 0 else None,
            )
            bottom += height
    if view["points"]:
        xs, ys = zip(*view["points"])
        ax.scatter(xs, ys, marker="x", s=80, color="black", zorder=3, label="measured (notebook)")
    ax.set_xticks(range(4), STAGES)
    ax.set_xlabel("data parallelism (DP) and ZeRO stage")
    ax.set_ylabel("model states (bytes per parameter, per rank)")
    ax.set_title(f"N = {view['world_size']} ranks")
    ax.legend(fontsize="small")
    return ax


def plot_stage3_timeline(traces, ax=None):
    """One training step of ZeRO-3 per rank: gathers (communication), block forward/backward
    (compute) and frees (memory). A block's gather overlapping the previous block's compute is
    the prefetch."""
    from minitrain.runtime import trace

    return trace.plot_timeline(
        traces, ax=ax, title="ZeRO-3: gather → compute → free, next block prefetched"
    )


def build_zero_memory_widget(measured: list | None = None, traces=None):
    """Controls (parameters, ranks, stage, precision, offload) → summary line and bars;
    below, the stage 3 timeline if ``traces`` (per-rank events of one step) are given; last,
    FSDP's compute dtype → its bytes per rank and bytes sent per step, for the same Ψ and N."""
    import ipywidgets as w

    params = w.SelectionSlider(  # explicit sizes: a log slider's grid snaps 7.5e9 to 1e10
        options=[(label, int(n)) for label, n in MODEL_SIZES],
        value=int(7.5e9),
        description="parameters",
    )
    ranks = w.SelectionSlider(
        options=[1, 2, 4, 8, 16, 64, 256, 1024], value=64, description="ranks N"
    )
    stage = w.ToggleButtons(
        options=[(s, i) for i, s in enumerate(STAGES)], value=3, description="stage"
    )
    precision = w.ToggleButtons(options=["mixed", "fp32"], value="mixed", description="precision")
    offload = w.Checkbox(value=False, description="offload optimizer to CPU")
    compute = w.ToggleButtons(options=list(COMPUTE_DTYPES), value="bf16", description="FSDP dtype")
    status, fsdp_status = w.HTML(), w.HTML()
    image = w.Image(format="png")

    def update():
        view = compute_zero_memory(
            int(params.value), ranks.value, stage.value, precision.value, offload.value, measured
        )
        status.value = describe(view)
        fsdp_status.value = describe_fsdp(
            compute_fsdp(int(params.value), ranks.value, compute.value)
        )
        image.value = plot_png(lambda ax: plot_memory(view, ax), (7, 3.2))

    live([params, ranks, stage, precision, offload, compute], update)
    children = [w.HBox([params, ranks]), stage, w.HBox([precision, offload]), status, image]
    if traces is not None:
        children.append(
            w.Image(
                format="png", value=plot_png(lambda ax: plot_stage3_timeline(traces, ax), (7, 3.2))
            )
        )
    children.append(w.VBox([compute, fsdp_status]))  # FSDP: the same Ψ and N
    return w.VBox(children)
