"""Widget of notebook 04: link and bucket size → buckets, measured and modeled step, timeline.

Used by notebooks/04_collectives_and_data_parallel.ipynb. ``sweep_bucket_sizes`` measures
real training steps of ``minitrain.ddp.DataParallel`` for a few bucket sizes (all in one
launch, taking turns step by step), on a modeled link if given, beside the step time the α–β
model predicts for each (``cost_model.modeled_step``); ``sweep_links`` does it for several
links. The controls then only re-plot those measurements. ``compute_bucket_view`` is the pure
function behind the widget (unit tested); ``build_bucket_widget`` wires it to a link selector
(when the sweep has several links) and a slider.
"""

from __future__ import annotations

import math
import statistics

from minitrain.ddp import assign_buckets, hidden_share_per_step, summarize_shares
from minitrain.runtime import trace
from minitrain.widgets import live, plot_png


def _label(cap_mb: float) -> str:
    if cap_mb == 0:
        return "0 (one per parameter)"
    if math.isinf(cap_mb):
        return "inf (one flat bucket)"
    return f"{cap_mb:g} MB"


def _span(step_traces, name: str) -> float:
    """Median seconds of the events called ``name`` over the steps and ranks of a variant."""
    return statistics.median(e.end - e.start for ranks in step_traces for events in ranks
                             for e in events if e.name == name)


def sweep_bucket_sizes(caps_mb: list[float], config: dict | None = None, steps: int = 8,
                       world: int = 2, link=None, batch: int = 2) -> dict:
    """Measure one bucketed, overlapped DataParallel per bucket size on ``world`` ranks, on
    ``link`` (``measure``'s: a Link, a preset, or a function of backward's seconds).

    Returns {"caps": caps_mb, "param_bytes": [bytes of each trainable parameter],
    "step_time": {cap: seconds}, "traces": {cap: per-rank events of the last step},
    "step_traces": {cap: [per-rank events of step i] for every measured step}}, and on a link
    also "link" (the one used) and "model_step": {cap: seconds the α–β model predicts, with
    forward, optimizer and backward measured on the largest bucket size's steps}.
    """
    from minitrain.collectives.cost_model import modeled_step
    from minitrain.ddp.measure import QUICK_MODEL, measure
    from minitrain.model import GPT, GPTConfig

    config = config or QUICK_MODEL
    variants = {_label(c): {"bucket_cap_mb": c, "overlap": True} for c in caps_mb}
    result = measure(variants, config, steps=steps, world=world, batch=batch, link=link,
                     reference=_label(max(caps_mb)))
    params = [p for p in GPT(GPTConfig(**config)).parameters() if p.requires_grad]
    sweep = {
        "caps": list(caps_mb),
        "param_bytes": [p.numel() * p.element_size() for p in params],
        "step_time": {c: result["step_time"][_label(c)] for c in caps_mb},
        "traces": {c: result["traces"][_label(c)] for c in caps_mb},
        "step_traces": {c: result["step_traces"][_label(c)] for c in caps_mb},
    }
    if result["link"] is not None:
        fewest = result["step_traces"][_label(max(caps_mb))]  # the least launching: compute
        other = _span(fewest, "forward") + _span(fewest, "optimizer")
        sweep["link"] = result["link"]
        sweep["model_step"] = {c: modeled_step(result["bucket_bytes"][_label(c)],
                                               _span(fewest, "backward"), other, result["link"],
                                               world) for c in caps_mb}
    return sweep


def sweep_links(caps_mb: list[float], links: dict, **kwargs) -> dict:
    """``sweep_bucket_sizes`` on each of ``links`` (label → link): {"links": {label: sweep}}."""
    return {"links": {label: sweep_bucket_sizes(caps_mb, link=link, **kwargs)
                      for label, link in links.items()}}


def best_caps(sweep: dict) -> tuple[float, float | None]:
    """(the bucket size with the shortest measured step, the one the model predicts shortest
    — None without a link)."""
    measured = min(sweep["caps"], key=sweep["step_time"].get)
    model = sweep.get("model_step")
    return measured, (min(sweep["caps"], key=model.get) if model else None)


def count_buckets(param_bytes: list[int], cap_mb: float) -> int:
    """Number of buckets ``assign_buckets`` makes for parameters of these sizes (fp32)."""
    import torch

    params = [torch.empty(b // 4, device="meta") for b in param_bytes]  # sizes only, no data
    return len(assign_buckets(params, cap_mb * 2**20))


def compute_bucket_view(sweep: dict, cap_mb: float) -> dict:
    """What the widget shows for one measured bucket size: bucket count, step time (ms) and,
    on a link, the model's (ms), communication hidden behind compute — the median over the
    measured steps of each step's share (mean over ranks), with its quartiles — and the
    per-rank timeline of the last step."""
    if cap_mb not in sweep["step_time"]:
        raise ValueError(
            f"compute_bucket_view: bucket size {cap_mb!r} MB was not measured; "
            f"measured: {sweep['caps']}"
        )
    traces = sweep["traces"][cap_mb]
    steps = sweep.get("step_traces", {}).get(cap_mb) or [traces]
    spread = summarize_shares(hidden_share_per_step(steps))
    model = sweep.get("model_step", {}).get(cap_mb)
    return {
        "cap_mb": cap_mb,
        "label": _label(cap_mb),
        "buckets": count_buckets(sweep["param_bytes"], cap_mb),
        "step_ms": 1e3 * sweep["step_time"][cap_mb],
        "model_ms": None if model is None else 1e3 * model,
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


def _render_curve(sweep: dict, cap_mb: float) -> bytes:
    """Step time against bucket size: measured, and the model's on a link; the minima marked."""
    caps = sweep["caps"]
    x = range(len(caps))

    def draw(ax):
        ax.plot(x, [1e3 * sweep["step_time"][c] for c in caps], "o-", label="measured")
        if "model_step" in sweep:
            ax.plot(x, [1e3 * sweep["model_step"][c] for c in caps], "s--", label="α–β model")
        measured, model = best_caps(sweep)
        ax.axvline(caps.index(cap_mb), color="grey", alpha=0.3)
        title = f"shortest step: measured at {_label(measured)}"
        ax.set(xticks=list(x), xticklabels=[_label(c) for c in caps], ylabel="step (ms)",
               title=title + ("" if model is None else f", the model's at {_label(model)}"))
        ax.legend(fontsize="small")

    return plot_png(draw, (9, 2.4))


def build_bucket_widget(sweep: dict):
    """A link selector (a ``sweep_links`` sweep), a slider over the measured bucket sizes, a
    one-line summary, the step-time curve and the timeline."""
    import ipywidgets as w

    sweeps = sweep["links"] if "links" in sweep else {"": sweep}
    chooser = w.Dropdown(options=list(sweeps), description="link",
                         layout=w.Layout(width="500px", display="" if "links" in sweep else "none"))
    caps = next(iter(sweeps.values()))["caps"]
    slider = w.SelectionSlider(
        options=[(_label(c), c) for c in caps],
        value=caps[0],
        description="bucket size",
        style={"description_width": "initial"},
        layout=w.Layout(width="500px"),
    )
    summary, curve, image = w.HTML(), w.Image(format="png"), w.Image(format="png")

    def update():
        chosen = sweeps[chooser.value]
        view = compute_bucket_view(chosen, slider.value)
        model = "" if view["model_ms"] is None else f" (α–β model: {view['model_ms']:.1f} ms)"
        summary.value = (
            f"<b>{view['buckets']}</b> buckets · measured step "
            f"<b>{view['step_ms']:.1f} ms</b>{model} · "
            f"<b>{100 * view['hidden_share']:.0f}%</b> of communication hidden "
            f"behind compute (median of {view['steps']} steps; quartiles "
            f"{100 * view['hidden_quartiles'][0]:.0f}–{100 * view['hidden_quartiles'][1]:.0f}%)"
        )
        curve.value = _render_curve(chosen, slider.value)
        image.value = _render(view)

    live([chooser, slider], update)
    return w.VBox([chooser, slider, summary, curve, image])
