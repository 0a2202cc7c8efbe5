"""Chapter 3 widget: choose a checkpointing policy and a segment count, see what it costs.

Used by notebooks/03_activation_checkpointing.ipynb. Every number shown was measured
beforehand on a small GPT (``measure_checkpointing``: bytes saved for backward and their
peak through backward with ``LiveSavedBytes``, matmul FLOPs with FlopCounterMode, step
time), next to the formula of minitrain.checkpointing; moving the slider re-plots those
measurements, it does not re-run anything.
"""

from __future__ import annotations

from minitrain.checkpointing import policy_extra_flops, policy_peak_bytes, policy_saved_bytes
from minitrain.checkpointing.measure import compare_policies, tiny_setup
from minitrain.widgets import live, plot_png

WIDGET_POLICIES = ("none", "full", "selective", "every_k", "segments")
K_POLICIES = ("every_k", "segments")  # the policies the k slider applies to


def measure_checkpointing(n_layer: int = 8, batch: int = 8, repeats: int = 5, **config) -> dict:
    """Measurements of every policy on ``GPT(n_layer, dropout=0.1, **config)``.

    "every_k" and "segments" are measured for every k in 1..n_layer. Returns {"config",
    "batch", "rows": {(policy, k): row}} with rows as ``compare_policies`` gives them.
    """
    model, idx, targets = tiny_setup(n_layer, batch, **config)
    policies = [("none", 1), ("full", 1), ("selective", 1)]
    policies += [(p, k) for p in ("every_k", "segments") for k in range(1, n_layer + 1)]
    rows = compare_policies(model, idx, targets, policies, repeats)
    for row in rows:
        row.pop("timeline")
    return {"config": model.config, "batch": batch, "rows": dict(zip(policies, rows))}


def compute_checkpointing_view(data: dict, policy: str, k: int) -> dict:
    """What the widget shows for ``policy`` (and k, for every_k/segments): pure, no measuring.

    Returns the measured and predicted bytes saved after forward, the measured peak, the
    measured and predicted extra FLOPs (also as a fraction of the un-checkpointed step),
    the time ratio, and the curves over k (measured and predicted) for both k-policies.
    """
    if policy not in WIDGET_POLICIES:
        raise ValueError(f"policy must be one of {WIDGET_POLICIES}, got {policy!r}")
    cfg, batch, rows = data["config"], data["batch"], data["rows"]
    L = cfg.n_layer
    if not 1 <= k <= L:
        raise ValueError(f"k must be in [1, {L}], got {k}")
    key = (policy, k if policy in ("every_k", "segments") else 1)
    row, base = rows[key], rows[("none", 1)]
    ks = list(range(1, L + 1))
    return {
        "policy": row["policy"],
        "saved": row["saved"],
        "saved_predicted": policy_saved_bytes(cfg, batch, *key),
        "peak": row["peak"],
        "peak_predicted": policy_peak_bytes(cfg, batch, *key),
        "extra_flops": row["extra_flops"],
        "extra_flops_predicted": policy_extra_flops(cfg, batch, *key),
        "extra_flops_fraction": row["extra_flops"] / base["flops"],
        "time_ratio": row.get("time_ratio"),
        "base_saved": base["saved"],
        "curves": {
            "k": ks,
            **{
                f"{p}_{what}": [rows[(p, j)][what] for j in ks]
                for p in ("every_k", "segments")
                for what in ("saved", "peak")
            },
            **{
                f"{p}_predicted": [policy_saved_bytes(cfg, batch, p, j) for j in ks]
                for p in ("every_k", "segments")
            },
            **{
                f"{p}_peak_predicted": [policy_peak_bytes(cfg, batch, p, j) for j in ks]
                for p in ("every_k", "segments")
            },
        },
        "levels": {p: rows[(p, 1)]["peak"] for p in ("none", "full", "selective")},
    }


def _describe(view: dict) -> str:
    time = "" if view["time_ratio"] is None else f", step time x{view['time_ratio']:.2f}"
    return (
        f"<b>{view['policy']}</b>: saved {view['saved'] / 1e6:.2f} MB (formula "
        f"{view['saved_predicted'] / 1e6:.2f} MB), peak {view['peak'] / 1e6:.2f} MB (formula "
        f"{view['peak_predicted'] / 1e6:.2f} MB), "
        f"extra FLOPs {view['extra_flops'] / 1e6:.1f} M (formula "
        f"{view['extra_flops_predicted'] / 1e6:.1f} M, "
        f"+{100 * view['extra_flops_fraction']:.0f}% of a step){time}"
    )


def plot_checkpointing_view(view: dict, k: int, ax_memory=None, ax_cost=None):
    """Peak memory against k for both k-policies (+ levels of the others); costs of the choice."""
    import matplotlib.pyplot as plt

    if ax_memory is None:
        _, (ax_memory, ax_cost) = plt.subplots(
            1, 2, figsize=(12, 3.8), gridspec_kw={"width_ratios": [3, 1.4], "wspace": 0.75}
        )
    c, mb = view["curves"], 1e-6
    for p, color in (("segments", "C0"), ("every_k", "C1")):
        ax_memory.plot(
            c["k"],
            [v * mb for v in c[f"{p}_predicted"]],
            "-",
            color=color,
            alpha=0.5,
            label=f"{p}: saved, formula",
        )
        ax_memory.plot(
            c["k"],
            [v * mb for v in c[f"{p}_saved"]],
            "o",
            color=color,
            label=f"{p}: saved, measured",
        )
        ax_memory.plot(
            c["k"], [v * mb for v in c[f"{p}_peak"]], "x", color=color, label=f"{p}: peak, measured"
        )
        ax_memory.plot(
            c["k"],
            [v * mb for v in c[f"{p}_peak_predicted"]],
            "--",
            color=color,
            alpha=0.5,
            label=f"{p}: peak, formula",
        )
    for (name, level), style in zip(view["levels"].items(), (":", "--", "-.")):
        ax_memory.axhline(level * mb, color="gray", ls=style, label=f"{name}: measured peak")
    ax_memory.axvline(k, color="k", lw=0.8)
    ax_memory.set(
        xlabel="k (segments, or blocks per checkpoint; count)",
        ylabel="bytes held for backward (MB, log scale)",
        title="activation memory, measured vs formula",
    )
    ax_memory.set_yscale("log")
    ax_memory.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    labels = ["saved", "peak", "+FLOPs", "+time"]
    measured = [
        view["saved"] / view["base_saved"],
        view["peak"] / view["levels"]["none"],
        view["extra_flops_fraction"],
        (view["time_ratio"] or 1.0) - 1.0,
    ]
    ax_cost.bar(labels, measured, color=["C2", "C2", "C3", "C4"])
    ax_cost.set(
        title=f"{view['policy']}, relative to none",
        xlabel="quantity",
        ylabel="ratio (memory: of none; cost: extra fraction)",
        ylim=(min(0, *measured) * 1.1, max(1.05, *measured) * 1.05),
    )
    return ax_memory, ax_cost


def build_checkpointing_widget(data: dict | None = None, policy: str = "segments", k: int = 3):
    """An ipywidgets VBox: policy dropdown + k slider -> measured/predicted memory, FLOPs, time."""
    import ipywidgets as widgets

    data = data or measure_checkpointing()
    L = data["config"].n_layer
    chooser = widgets.Dropdown(options=list(WIDGET_POLICIES), value=policy, description="policy")
    slider = widgets.IntSlider(value=min(k, L), min=1, max=L, description="k")
    slider.disabled = policy not in K_POLICIES
    readout, image = widgets.HTML(), widgets.Image(format="png")

    def redraw():
        slider.disabled = chooser.value not in K_POLICIES  # k means nothing for the others
        view = compute_checkpointing_view(data, chooser.value, slider.value)
        readout.value = _describe(view)
        image.value = plot_png(
            lambda axes: plot_checkpointing_view(view, slider.value, *axes),
            figsize=(12, 3.8),
            ncols=2,
            gridspec_kw={"width_ratios": [3, 1.4]},
        )

    live([chooser, slider], redraw)
    return widgets.VBox([widgets.HBox([chooser, slider]), readout, image])
