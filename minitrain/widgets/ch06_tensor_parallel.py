"""Widget of notebook 06: which slice of each weight a rank holds, which collective runs
where, and the bytes moved and saved per rank — measured next to the formulas.

Used by notebooks/06_tensor_parallel.ipynb. ``compute_tp_view`` is the pure function behind
it (unit tested). It reads real measurements (``minitrain.tensor_parallel.measure.
measure_layers``, one run per TP size and SP setting): the slices come from matching each
rank's shard against the dense weight, the collectives from the communication log, the
activation bytes from ``saved_activation_bytes``. Shoeybi et al. 2019 (section 3, Figure 3)
for the splits; Korthikanti et al. 2022 (sections 4 and 4.2.2) for memory and SP.
"""

from __future__ import annotations

from minitrain.tensor_parallel.measure import (
    layer_activation_bytes,
    layer_collectives,
    summarize_log,
    total_bytes,
)
from minitrain.widgets import live, plot_png

# layer -> split -> the modules (names in the GPT) split that way
SPLITS = {
    "attention": {"column": ["blocks.0.attn.q_proj", "blocks.0.attn.k_proj",
                             "blocks.0.attn.v_proj"], "row": ["blocks.0.attn.out_proj"]},
    "mlp": {"column": ["blocks.0.mlp.fc_in"], "row": ["blocks.0.mlp.fc_out"]},
    "embedding": {"vocab": ["tok_emb"]},
    "head": {"vocab": ["head"]},  # column-parallel over the vocabulary: rows of the head
}
RANK_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B2", "#937860"]


def compute_tp_view(layer, split, tp_size, sequence_parallel, measured, shape) -> dict:
    """What the widget shows for one choice.

    ``measured[(t, sp)]`` is ``measure_layers(...)`` for that TP size and SP setting;
    ``shape`` the batch and model sizes they were measured at (batch, seq_len, d_model,
    n_head, d_ff, vocab_size). A split the layer does not have falls back to its first.
    """
    if (tp_size, sequence_parallel) not in measured:
        raise ValueError(f"no measurement for TP size {tp_size}, sequence_parallel={sequence_parallel}")
    if split not in SPLITS[layer]:
        split = next(iter(SPLITS[layer]))
    run = measured[(tp_size, sequence_parallel)]
    weights = []
    for module in SPLITS[layer][split]:
        for name in (f"{module}.weight", f"{module}.bias"):
            if name in run["layout"][0]:
                weights.append((name, [layout[name] for layout in run["layout"]]))
    b, s, h = shape["batch"], shape["seq_len"], shape["d_model"]
    fwd, bwd = layer_collectives(layer, b, s, h, tp_size, sequence_parallel, True, s)
    got = run["layers"][layer]

    def activation(t, sp):
        return layer_activation_bytes(layer, b, s, h, shape["n_head"], shape["d_ff"],
                                      shape["vocab_size"], t, sp)

    curves = {
        sp: [(t, measured[(t, sp)]["layers"][layer]["activation_bytes"][0], activation(t, sp))
             for t in sorted(t for t, p in measured if p == sp)]
        for sp in (False, True)
    }
    return {
        "layer": layer, "split": split, "tp_size": tp_size, "sp": sequence_parallel,
        "weights": weights,
        "measured": {"forward": summarize_log(got["forward"]),
                     "backward": summarize_log(got["backward"])},
        "formula": {"forward": total_bytes(fwd, tp_size), "backward": total_bytes(bwd, tp_size)},
        "activation": {"measured": got["activation_bytes"],
                       "formula": activation(tp_size, sequence_parallel)},
        "curves": curves,
    }


def _slice_text(entry, rank) -> str:
    if entry[0] == "replicated":
        return "all of it (replicated)"
    _, dim, start, stop, full = entry
    what = "rows" if dim == 0 else "columns"
    return f"{what} {start}–{stop - 1} of {full}"


def _ops(summary) -> str:
    names = summary["collectives"]
    return ", ".join(f"{n} ×{names.count(n)}" for n in dict.fromkeys(names)) or "none"


def describe(view: dict) -> str:
    rows = "".join(
        f"<li>{name}: " + "; ".join(f"rank {r} holds {_slice_text(e, r)}" for r, e in
                                     enumerate(entries)) + "</li>"
        for name, entries in view["weights"])
    lines = [f"<b>{view['layer']}</b>, {view['split']} split, t = {view['tp_size']}, "
             f"sequence parallelism {'on' if view['sp'] else 'off'}<ul>{rows}</ul>"]
    for d in ("forward", "backward"):
        m, f = view["measured"][d], view["formula"][d]
        lines.append(f"{d}: {_ops(m)} — measured {m['message_bytes']} B in messages, "
                     f"{m['ring_bytes']} B sent per rank on a ring; formula {f['message_bytes']} B, "
                     f"{f['ring_bytes']} B")
    act = view["activation"]
    lines.append(f"activations saved per rank: measured {act['measured']} B, formula "
                 f"{act['formula']} B")
    return "<br>".join(lines)


def plot_view(view: dict, axes=None):
    """Left: the first weight's matrix, each rank's slice in its colour. Right: activation
    bytes per rank against the TP size, measured (markers) and formula (lines)."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    ax, ax2 = axes
    name, entries = view["weights"][0]
    for rank, e in enumerate(entries):
        if e[0] == "replicated":  # every rank holds all of it: draw rank 0's copy
            ax.add_patch(plt.Rectangle((0, 0), 1, 1, color=RANK_COLORS[0],
                                       label=f"all {len(entries)} rank(s): replicated"))
            break
        _, dim, start, stop, full = e
        # nn.Linear / nn.Embedding weights are (out or vocab, in): rows on y, columns on x
        x0, x1, y0, y1 = (0, 1, start / full, stop / full) if dim == 0 else (start / full, stop / full, 0, 1)
        ax.add_patch(plt.Rectangle((x0, y0), x1 - x0, y1 - y0, color=RANK_COLORS[rank % 6],
                                   label=f"rank {rank}"))
    ax.set_xlim(0, 1), ax.set_ylim(1, 0)
    ax.set_xlabel("input features (fraction of the dense width)")
    ax.set_ylabel("output rows (fraction)")
    ax.set_title(f"{name}", fontsize="small")
    ax.legend(fontsize="x-small", loc="lower right")
    for sp, style in ((False, "-"), (True, "--")):
        ts = [t for t, _, _ in view["curves"][sp]]
        ax2.plot(ts, [f / 1e3 for _, _, f in view["curves"][sp]], style, color="gray",
                 label=f"formula, SP {'on' if sp else 'off'}")
        ax2.plot(ts, [m / 1e3 for _, m, _ in view["curves"][sp]], "o" if sp else "x",
                 color="black", label=f"measured, SP {'on' if sp else 'off'}")
    ax2.set_xticks(sorted({t for t, _, _ in view["curves"][False]}))
    ax2.set_xlabel("tensor-parallel size t (ranks)")
    ax2.set_ylabel("activations saved per rank (kB)")
    ax2.set_title(f"{view['layer']}: activation memory", fontsize="small")
    ax2.legend(fontsize="x-small")
    return axes


def build_tp_widget(measured: dict, shape: dict):
    """Controls (layer, split, TP size, SP) → status line (slices, collectives, bytes) and
    the picture; ``measured`` and ``shape`` as for ``compute_tp_view``. The split buttons
    offer only the chosen layer's splits: a button that could change nothing is not shown."""
    import ipywidgets as w

    layer = w.ToggleButtons(options=list(SPLITS), value="attention", description="layer")
    split = w.ToggleButtons(options=list(SPLITS["attention"]), description="split")
    sizes = sorted({t for t, _ in measured})
    tp = w.ToggleButtons(options=sizes, value=sizes[min(1, len(sizes) - 1)], description="TP size t")
    sp = w.Checkbox(value=False, description="sequence parallelism")
    status, image = w.HTML(), w.Image(format="png")
    changing_layer = False

    def update():
        if changing_layer:  # new split options set split.value too: draw once, afterwards
            return
        view = compute_tp_view(layer.value, split.value, tp.value, sp.value, measured, shape)
        status.value = describe(view)
        image.value = plot_png(lambda axes: plot_view(view, axes), (9, 3.2), ncols=2)

    def choose_layer():
        nonlocal changing_layer
        changing_layer = True
        try:
            split.options = list(SPLITS[layer.value])  # selects the layer's first split
        finally:
            changing_layer = False
        update()

    live([layer], choose_layer, now=False)
    live([split, tp, sp], update)
    return w.VBox([layer, split, w.HBox([tp, sp]), status, image])
