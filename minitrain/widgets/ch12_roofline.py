"""Widget of notebook 12: the ops of an MLP sub-block on this machine's roofline, eager against
fused, with sliders for the width and the number of tokens.

Used by notebooks/12_kernels_and_compilers.ipynb. ``compute_roofline_view`` (pure) places each
op of ``minitrain.kernels.roofline.mlp_ops`` at its arithmetic intensity and attainable FLOP/s
and sums the bytes moved and the roofline's time; the machine's peak FLOP/s and bandwidth are
measured once by the notebook and passed in.
"""

from __future__ import annotations

from minitrain.kernels.roofline import attainable, mlp_ops, predicted_seconds
from minitrain.widgets import live, plot_png


def compute_roofline_view(d: int, tokens: int, flops: float, bandwidth: float) -> dict:
    """Both versions of the sub-block at width ``d`` on ``tokens`` tokens: their ops (with
    "attainable" FLOP/s), total bytes, predicted seconds, and which ops are memory-bound."""
    if d < 1 or tokens < 1:
        raise ValueError(f"width and tokens must be positive, got d={d}, tokens={tokens}")
    ridge = flops / bandwidth
    view = {"d": d, "tokens": tokens, "ridge": ridge}
    for name, fused in (("eager", False), ("fused", True)):
        ops = [dict(op, attainable=attainable(op["intensity"], flops, bandwidth))
               for op in mlp_ops(tokens, d, fused)]
        view[name] = {"ops": ops, "bytes": sum(op["bytes"] for op in ops),
                      "seconds": predicted_seconds(ops, flops, bandwidth),
                      "memory_bound": [op["name"] for op in ops if op["intensity"] < ridge]}
    view["speedup"] = view["eager"]["seconds"] / view["fused"]["seconds"]
    return view


def plot_roofline_view(view: dict, flops: float, bandwidth: float, ax=None):
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4))
    lo, hi = 0.05, 4 * max(op["intensity"] for op in view["eager"]["ops"] + view["fused"]["ops"])
    xs = [lo * (hi / lo) ** (i / 99) for i in range(100)]
    ax.loglog(xs, [attainable(x, flops, bandwidth) / 1e9 for x in xs], "k-", lw=1)
    for name, marker in (("eager", "o"), ("fused", "s")):
        ops = view[name]["ops"]
        ax.loglog([op["intensity"] for op in ops], [op["attainable"] / 1e9 for op in ops], marker,
                  label=f"{name}: {view[name]['bytes'] / 1e6:.1f} MB moved", alpha=0.7)
    ax.axvline(view["ridge"], color="grey", ls=":", lw=1)
    ax.set(xlabel="arithmetic intensity (FLOP/byte)", ylabel="attainable GFLOP/s",
           title=f"MLP sub-block, d = {view['d']}, {view['tokens']} tokens: fused is "
                 f"{view['speedup']:.2f}x faster on the roofline")
    ax.legend(fontsize=8)
    return ax


def build_roofline_widget(flops: float, bandwidth: float, d: int = 256, tokens: int = 1024):
    import ipywidgets as widgets

    width = widgets.IntSlider(value=d, min=64, max=4096, step=64, description="width d")
    count = widgets.IntSlider(value=tokens, min=64, max=16384, step=64, description="tokens")
    readout, image = widgets.HTML(), widgets.Image(format="png")

    def redraw():
        view = compute_roofline_view(width.value, count.value, flops, bandwidth)
        readout.value = (
            f"ridge point {view['ridge']:.1f} FLOP/byte; memory-bound ops, eager: "
            f"{', '.join(view['eager']['memory_bound']) or 'none'}; fused: "
            f"{', '.join(view['fused']['memory_bound']) or 'none'}<br>bytes moved "
            f"{view['eager']['bytes'] / 1e6:.1f} MB eager, {view['fused']['bytes'] / 1e6:.1f} MB fused; "
            f"roofline time {view['eager']['seconds'] * 1e3:.2f} ms against "
            f"{view['fused']['seconds'] * 1e3:.2f} ms")
        image.value = plot_png(lambda ax: plot_roofline_view(view, flops, bandwidth, ax),
                               figsize=(8, 4))

    live([width, count], redraw)
    return widgets.VBox([widgets.HBox([width, count]), readout, image])
