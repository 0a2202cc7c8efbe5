"""Widget of notebook 10: which query/key blocks each rank computes at each ring step, and
the work each rank really does — contiguous against zigzag.

Used by notebooks/10_context_parallel.ipynb. ``compute_cp_view`` is the pure function
behind it (unit tested): the schedule (``minitrain.context_parallel.measure.schedule``:
for rank r at step s, its query chunks against the key chunks of the block that started
on rank r − s, the future skipped and the diagonal masked under causal attention) and the
per-rank work measured by running the real ``ring_step`` for every rank and step
(``measure.work_per_step``: FLOPs counted by torch, CPU seconds), next to the formula.
Liu et al. 2023 for the ring; the zigzag layout balances causal work.
"""

from __future__ import annotations

from minitrain.context_parallel.layout import num_chunks
from minitrain.context_parallel.measure import forward_flops, schedule, work_per_step
from minitrain.widgets import figure_png, live, offscreen_figure

RANK_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B2", "#937860"]


def compute_cp_view(seq_len, world_size, layout="zigzag", causal=True, repeats=1) -> dict:
    """What the widget shows for one choice: the schedule, measured and formula work."""
    plan = schedule(seq_len, world_size, layout, causal)
    measured = work_per_step(seq_len, world_size, layout, causal, repeats=repeats)
    flops = [sum(steps) for steps in measured["flops"]]
    seconds = [sum(steps) for steps in measured["seconds"]]
    return {"seq_len": seq_len, "world_size": world_size, "layout": layout, "causal": causal,
            "chunk": seq_len // num_chunks(world_size, layout), "schedule": plan,
            "flops": flops, "formula_flops": forward_flops(seq_len, world_size, layout, causal, 2, 32),
            "seconds": seconds, "flops_per_step": measured["flops"],
            "balance": max(flops) / min(flops)}


def describe(view: dict) -> str:
    P = view["world_size"]
    lines = [f"N = {view['seq_len']}, P = {P}, {view['layout']}, "
             f"{'causal' if view['causal'] else 'full'} attention: chunks of {view['chunk']} tokens"]
    for r, steps in enumerate(view["schedule"]):
        blocks = "; ".join(f"step {s}: " + (", ".join(f"q{i}·k{j}{'◣' if d else ''}" for i, j, d in pairs)
                                            or "nothing") for s, pairs in enumerate(steps))
        lines.append(f"rank {r} — {blocks}")
    lines.append("forward FLOPs per rank, measured: " + ", ".join(f"{f:,}" for f in view["flops"])
                 + f" (formula equal: {view['flops'] == view['formula_flops']})")
    lines.append("CPU ms per rank: " + ", ".join(f"{1e3 * s:.1f}" for s in view["seconds"]))
    lines.append(f"work balance, busiest / idlest rank: {view['balance']:.2f}")
    return "<br>".join(lines)


def plot_view(view: dict, fig=None):
    """Rows: ranks; columns: ring steps — the N×N score matrix with the part this rank
    computes at this step coloured (the causal mask drawn on diagonal chunks); last column:
    the measured FLOPs per rank."""
    import matplotlib.pyplot as plt
    import numpy as np

    P, c, N = view["world_size"], view["chunk"], view["seq_len"]
    if fig is None:
        fig = plt.figure(figsize=figure_size(P))
    axes = fig.subplots(P, P + 1, squeeze=False)
    for r, steps in enumerate(view["schedule"]):
        for s, pairs in enumerate(steps):
            grid = np.ones((N, N, 3))
            for qi, kj, diagonal in pairs:
                block = np.ones((c, c, 3)) * np.array(_rgb(RANK_COLORS[r % 6]))
                if diagonal:  # the causal mask: keys after the query stay blank
                    block[np.triu(np.ones((c, c), dtype=bool), 1)] = 1.0
                grid[qi * c:(qi + 1) * c, kj * c:(kj + 1) * c] = block
            ax = axes[r][s]
            ax.imshow(grid, interpolation="nearest")
            ax.set_xticks([]), ax.set_yticks([])
            if r == 0:
                ax.set_title(f"step {s}", fontsize="small")
            if s == 0:
                ax.set_ylabel(f"rank {r}\nqueries", fontsize="small")
        bar = axes[r][P]
        bar.barh([0], [view["flops"][r] / 1e6], color=RANK_COLORS[r % 6])
        bar.set_xlim(0, max(view["flops"]) / 1e6 * 1.05)
        bar.set_yticks([])
        if r == P - 1:
            bar.set_xlabel("MFLOP (measured)", fontsize="small")
    axes[P - 1][0].set_xlabel("keys", fontsize="small")
    return fig


def _rgb(color: str):
    return tuple(int(color[i:i + 2], 16) / 255 for i in (1, 3, 5))


def figure_size(world_size: int) -> tuple[float, float]:
    """Inches for ``plot_view``'s grid of P rows and P + 1 columns."""
    return 1.6 * world_size + 2.6, 1.5 * world_size + 0.4


def _png(view) -> bytes:
    return figure_png(plot_view(view, offscreen_figure(figure_size(view["world_size"]))), dpi=70)


def build_cp_widget(seq_lens=(64, 128, 256), sizes=(2, 3, 4)):
    """Controls (sequence length, CP size, layout, causal) → status line and picture."""
    import ipywidgets as w

    seq = w.ToggleButtons(options=list(seq_lens), value=seq_lens[-1], description="N")
    size = w.ToggleButtons(options=list(sizes), value=sizes[-1], description="CP size P")
    layout = w.ToggleButtons(options=["contiguous", "zigzag"], value="contiguous", description="layout")
    causal = w.Checkbox(value=True, description="causal")
    status, image = w.HTML(), w.Image(format="png")

    def update():
        try:
            view = compute_cp_view(seq.value, size.value, layout.value, causal.value)
        except ValueError as exc:  # N not divisible by P or 2P: say so instead of drawing
            status.value = f"<b>{exc}</b>"
            return
        status.value = describe(view)
        image.value = _png(view)

    live([seq, size, layout, causal], update)
    return w.VBox([seq, size, w.HBox([layout, causal]), status, image])
