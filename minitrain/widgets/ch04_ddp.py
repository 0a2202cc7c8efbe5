"""Widget of notebook 04: bucket size → number of buckets, measured step time, timeline.

Used by notebooks/04_collectives_and_data_parallel.ipynb. ``sweep_bucket_sizes`` measures
real training steps of ``minitrain.ddp.DataParallel`` for a few bucket sizes (all in one
launch, taking turns step by step); the slider then only re-plots those measurements.
``compute_bucket_view`` is the pure function behind the widget (unit tested);
``build_bucket_widget`` wires it to a slider.
"""

from __future__ import annotations

import math

from minitrain.ddp import assign_buckets, hidden_share_per_step, summarize_shares
from minitrain.runtime import trace
from minitrain.widgets import live, plot_png


def _label(cap_mb: float) -> str:
    if cap_mb == 0:
        return "0 (one per parameter)"
    if math.isinf(cap_mb):
        return "inf (one flat bucket)"
    return f"{cap_mb:g} MB"


def sweep_bucket_sizes(
    caps_mb: list[float], config: dict | None = None, steps: int = 8, world: int = 2
) -> dict:
    """Measure one bucketed, overlapped DataParallel per bucket size on ``world`` ranks.

    Returns {"caps": caps_mb, "param_bytes": [bytes of each trainable parameter],
    "step_time": {cap: seconds}, "traces": {cap: per-rank events of the last step},
    "step_traces": {cap: [per-rank events of step i] for every measured step}}.
    """
    from minitrain.ddp.measure import QUICK_MODEL, measure
    from minitrain.model import GPT, GPTConfig

    config = config or QUICK_MODEL
    variants = {_label(c): {"bucket_cap_mb": c, "overlap": True} for c in caps_mb}
    result = measure(variants, config, steps=steps, world=world)
    params = [p for p in GPT(GPTConfig(**config)).parameters() if p.requires_grad]
    return {
        "caps": list(caps_mb),
        "param_bytes": [p.numel() * p.element_size() for p in params],
        "step_time": {c: result["step_time"][_label(c)] for c in caps_mb},
        "traces": {c: result["traces"][_label(c)] for c in caps_mb},
        "step_traces": {c: result["step_traces"][_label(c)] for c in caps_mb},
    }


def count_buckets(param_bytes: list[int], cap_mb: float) -> int:
    """Number of buckets ``assign_buckets`` makes for parameters of these sizes (fp32)."""
    import torch

    params = [torch.empty(b // 4, device="meta") for b in param_bytes]  # sizes only, no data
    return len(assign_buckets(params, cap_mb * 2**20))


def compute_bucket_view(sweep: dict, cap_mb: float) -> dict:
    """What the widget shows for one measured bucket size: bucket count, step time (ms),
    communication hidden behind compute — the median over the measured steps of each step's
    share (mean over ranks), with its quartiles — and the per-rank timeline of the last step."""
    if cap_mb not in sweep["step_time"]:
        raise ValueError(
            f"compute_bucket_view: bucket size {cap_mb!r} MB was not measured; "
            f"measured: {sweep['caps']}"
        )
    traces = sweep["traces"][cap_mb]
    steps = sweep.get("step_traces", {}).get(cap_mb) or [traces]
    spread = summarize_shares(hidden_share_per_step(steps))
    return {
        "cap_mb": cap_mb,
        "label": _label(cap_mb),
        "buckets": count_buckets(sweep["param_bytes"], cap_mb),
        "step_ms": 1e3 * sweep["step_time"][cap_mb],
        "hidden_share": spread["median"],
        "hidden_quartiles": (spread["q1"], spread["q3"]),
        "steps": spread["steps"],
        "traces": traces,
    }


def _render(view: dict) -> bytes:
    title = (
        f"bucket {view['label']}: {view['buckets']} buckets, step {view['step_ms']:.1f} ms, "
        f"median {100 * view['hidden_share']:.0f}% of communication hidden ({view['steps']} steps)"
    )
    return plot_png(lambda ax: trace.plot_timeline(view["traces"], ax=ax, title=title), (9, 2.2))


def build_bucket_widget(sweep: dict):
    """A slider over the measured bucket sizes, a one-line summary and the timeline."""
    import ipywidgets as w

    slider = w.SelectionSlider(
        options=[(_label(c), c) for c in sweep["caps"]],
        value=sweep["caps"][0],
        description="bucket size",
        style={"description_width": "initial"},
        layout=w.Layout(width="500px"),
    )
    summary = w.HTML()
    image = w.Image(format="png")

    def update():
        view = compute_bucket_view(sweep, slider.value)
        summary.value = (
            f"<b>{view['buckets']}</b> buckets · measured step "
            f"<b>{view['step_ms']:.1f} ms</b> · "
            f"<b>{100 * view['hidden_share']:.0f}%</b> of communication hidden "
            f"behind compute (median of {view['steps']} steps; quartiles "
            f"{100 * view['hidden_quartiles'][0]:.0f}–{100 * view['hidden_quartiles'][1]:.0f}%)"
        )
        image.value = _render(view)

    live([slider], update)
    return w.VBox([slider, summary, image])
