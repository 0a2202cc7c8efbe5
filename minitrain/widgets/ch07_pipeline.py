"""Widget of notebook 07: a schedule drawn from its data next to the measured timeline of the
same run, with the predicted and measured bubble and peak memory.

Used by notebooks/07_pipeline_parallel.ipynb. ``compute_pipeline_view`` is the pure function
behind it (unit tested): from one ``minitrain.pipeline.measure.run_pipelines`` result it
builds the stage x time grid of F/B/W cells (``check.simulate`` of the schedule data, unit
costs), the measured per-rank timeline, and the numbers. The builder measures each new
choice once (one launch, cached): with the **calibrated-sleep stage** the timeline depends on
the schedule alone; with the GPT (real compute) the peak activation bytes are measured.
GPipe (Huang et al. 2019), 1F1B and interleaved (Narayanan et al. 2021), ZB-H1 (Qi et al. 2024).
"""

from __future__ import annotations

from minitrain.widgets import live, plot_png

CELL_COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


def compute_pipeline_view(name: str, p: int, m: int, v: int, kind: str, result: dict) -> dict:
    """What the widget shows for one run. ``result`` is ``run_pipelines(kind, p, m,
    [(name, v)])[(name, v)]``."""
    sim = result["simulation"]
    grid = grid_of(sim)
    t0 = min(e.start for evs in result["events"] for e in evs)
    measured = [[(e.start - t0, e.end - t0, e.name, e.kind) for e in evs] for evs in result["events"]]
    view = dict(name=name, p=p, m=m, v=v, kind=kind, grid=grid, measured=measured,
                predicted_bubble=float(sim.bubble_fraction),
                measured_bubble=result["measured_bubble"],
                peak_in_flight=list(sim.peak_in_flight), makespan=float(sim.makespan),
                seconds=result["seconds"])
    if "predicted_peak_bytes" in result:
        view["peak_bytes"] = result["peak_bytes"]
        view["predicted_peak_bytes"] = result["predicted_peak_bytes"]
    return view


def describe(view: dict) -> str:
    label = "calibrated-sleep stage" if view["kind"] == "sleep" else "the course's GPT, real compute"
    lines = [f"<b>{view['name']}</b>, p = {view['p']}, m = {view['m']}, v = {view['v']} — {label}",
             f"bubble: predicted {view['predicted_bubble']:.3f}, measured {view['measured_bubble']:.3f}",
             f"peak in-flight micro-batches per stage (schedule): {view['peak_in_flight']}"]
    if "peak_bytes" in view:
        lines.append(f"peak activation bytes per stage: measured {view['peak_bytes']}, "
                     f"in-flight formula {view['predicted_peak_bytes']}")
    else:
        lines.append("peak activation bytes: choose the GPT stage (a sleep holds no activations)")
    return "<br>".join(lines)


def plot_schedule(grid, ax, num_chunks: int = 1, title: str | None = None):
    """Draw a stage x time grid of F/B/W cells: ``grid[s]`` is stage s's list of
    (start, end, kind, mb, chunk) — ``check.simulate(...).timeline`` turned into tuples."""
    for s, cells in enumerate(grid):
        for start, end, kind, mb, c in cells:
            ax.broken_barh([(start, end - start)], (s - 0.4, 0.8), facecolors=CELL_COLORS[kind],
                           edgecolor="white", alpha=1.0 if c % 2 == 0 else 0.6)
            label = f"{kind}{mb}" if num_chunks == 1 else f"{kind}{mb}.{c}"
            ax.text((start + end) / 2, s, label, ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(grid)))
    ax.set_yticklabels([f"stage {s}" for s in range(len(grid))])
    ax.invert_yaxis()
    ax.set_xlabel("time (units: one stage forward)")
    if title:
        ax.set_title(title, fontsize="small")
    return ax


def grid_of(simulation) -> list:
    """``simulate``'s timeline as plain tuples (start, end, kind, mb, chunk) per stage."""
    return [[(float(start), float(end), a[0], a[1], a[2] if len(a) > 2 else 0)
             for start, end, a in row] for row in simulation.timeline]


def plot_view(view: dict, axes=None):
    """Top: the schedule data as a stage x time grid (unit costs). Bottom: the measured run."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(2, 1, figsize=(10, 1.2 + 1.1 * view["p"]))
    ax, ax2 = axes
    plot_schedule(view["grid"], ax, view["v"], f"schedule data: bubble {view['predicted_bubble']:.3f}")
    for r, evs in enumerate(view["measured"]):
        for start, end, name, kind in evs:
            if kind != "compute":
                continue
            ax2.broken_barh([(start * 1e3, (end - start) * 1e3)], (r - 0.4, 0.8),
                            facecolors=CELL_COLORS.get(name[0], "#888888"), edgecolor="white")
    ax2.set_yticks(range(view["p"]))
    ax2.set_yticklabels([f"rank {r}" for r in range(view["p"])])
    ax2.invert_yaxis()
    ax2.set_xlabel("time (ms)")
    ax2.set_title(f"measured: bubble {view['measured_bubble']:.3f}", fontsize="small")
    return axes


def build_pipeline_widget(unit: float = 0.01, cache: dict | None = None):
    """Controls (schedule, p, m, v, stage kind) → the two pictures and the numbers; each
    new choice is measured once (one launch of p ranks) and cached in ``cache``."""
    import ipywidgets as w

    from minitrain.pipeline.measure import run_pipelines

    cache = {} if cache is None else cache
    name = w.Dropdown(options=["gpipe", "1f1b", "interleaved", "zero_bubble"], value="1f1b",
                      description="schedule")
    p = w.IntSlider(value=2, min=2, max=4, description="stages p")
    m = w.IntSlider(value=4, min=1, max=8, description="micro-batches m")
    v = w.IntSlider(value=2, min=2, max=3, description="chunks v")
    kind = w.ToggleButtons(options=["sleep", "gpt"], value="sleep", description="stage")
    status, image = w.HTML(), w.Image(format="png")

    def update():
        chunks = v.value if name.value == "interleaved" else 1
        key = (name.value, p.value, m.value, chunks, kind.value)
        if key not in cache:
            config = dict(vocab_size=32, seq_len=16, n_layer=p.value * chunks, n_head=2, d_model=16)
            cache[key] = run_pipelines(kind.value, p.value, m.value, [(name.value, chunks)],
                                       unit=unit, config=config)[(name.value, chunks)]
        view = compute_pipeline_view(name.value, p.value, m.value, chunks, kind.value, cache[key])
        status.value = describe(view)
        image.value = plot_png(lambda axes: plot_view(view, axes), (10, 1.2 + 1.1 * view["p"]),
                               dpi=70, nrows=2)

    live([name, p, m, v, kind], update)
    return w.VBox([w.HBox([name, kind]), w.HBox([p, m, v]), status, image])
