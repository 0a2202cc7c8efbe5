"""Chapter 1 widget: a training-memory calculator for minitrain's GPT.

Used by notebooks/01_single_device_training.ipynb. Choose the model (layers, width, heads,
vocabulary, sequence), the precision and the micro-batch; see stacked bars of weights,
gradients, optimizer state and activations for micro-batches 1, 2, 4, ... against a
device-memory line. Model states come from ``estimate_training_memory`` (Adam), the
activations from the exact per-block formula ``block_activation_bytes`` (measured in the
notebook); the notebook's measured point is overlaid when the sliders match its model.
"""

from __future__ import annotations

from minitrain.memory import estimate_training_memory, model_activation_bytes
from minitrain.model import GPTConfig, gpt_num_params
from minitrain.widgets import live, plot_png

DEVICES_GB = {
    "8 GB (laptop)": 8,
    "24 GB (RTX 4090)": 24,
    "40 GB (A100)": 40,
    "80 GB (H100)": 80,
    "141 GB (H200)": 141,
}
PARTS = ("weights", "gradients", "optimizer", "activations")


def _micro_batches(batch: int) -> list[int]:
    sizes = [1 << i for i in range(batch.bit_length()) if 1 << i <= batch]
    return sizes if sizes[-1] == batch else sizes + [batch]


def compute_memory_breakdown(
    n_layer: int,
    d_model: int,
    n_head: int,
    vocab_size: int,
    seq_len: int,
    batch: int,
    precision: str = "fp32",
) -> dict:
    """Bytes per part for micro-batches 1, 2, 4, ..., ``batch`` of ``GPT(config)`` with Adam.

    Returns {"num_params", "batch_sizes", "weights", "gradients", "optimizer",
    "activations" (a list, one per batch size), "totals" (a list)}. Gradients include
    mixed precision's fp32 accumulation buffer and optimizer the fp32 master weights.
    Activations: ``model_activation_bytes`` with 4-byte (fp32, exact) or 2-byte (mixed,
    an estimate: activations in bf16, LayerNorm statistics and log-softmax in fp32).
    """
    config = GPTConfig(
        vocab_size=vocab_size, seq_len=seq_len, n_layer=n_layer, n_head=n_head, d_model=d_model
    )
    if batch < 1:
        raise ValueError(f"batch must be positive, got {batch}")
    num_params = gpt_num_params(config)
    states = estimate_training_memory(num_params, precision)
    e = 4 if precision == "fp32" else 2
    sizes = _micro_batches(batch)
    activations = [model_activation_bytes(config, b, bytes_per_element=e) for b in sizes]
    fixed = {
        "weights": states["weights"],
        "gradients": states["gradients"] + states["gradient_accumulation"],
        "optimizer": states["optimizer"] + states["master"],
    }
    return {
        "num_params": num_params,
        "batch_sizes": sizes,
        **fixed,
        "activations": activations,
        "totals": [sum(fixed.values()) + a for a in activations],
    }


def _unit(nbytes: float) -> tuple[float, str]:
    for scale, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if nbytes >= scale:
            return scale, name
    return 1.0, "B"


def build_memory_widget(
    measured: dict | None = None, config: GPTConfig | None = None, batch: int = 8
):
    """An ipywidgets VBox: sliders -> stacked bars (``compute_memory_breakdown``).

    ``measured``: {"batch", "bytes", "precision", "config"} from the notebook's
    measurement, drawn as a marker when the sliders describe that model.
    """
    import ipywidgets as widgets

    config = config or GPTConfig()
    style = {"description_width": "110px"}
    controls = {
        "n_layer": widgets.IntSlider(config.n_layer, 1, 128, description="layers L", style=style),
        "d_model": widgets.SelectionSlider(
            options=sorted(
                {64, 128, 256, 512, 768, 1024, 2048, 4096, 8192, 12288, 16384, config.d_model}
            ),
            value=config.d_model,
            description="width h",
            style=style,
        ),
        "n_head": widgets.SelectionSlider(
            options=sorted({1, 2, 4, 8, 16, 32, 64, 128, config.n_head}),
            value=config.n_head,
            description="heads a",
            style=style,
        ),
        "vocab_size": widgets.Dropdown(
            options=sorted({config.vocab_size, 50257, 128256}),
            value=config.vocab_size,
            description="vocabulary v",
            style=style,
        ),
        "seq_len": widgets.SelectionSlider(
            options=sorted({config.seq_len, 128, 512, 1024, 2048, 4096, 8192}),
            value=config.seq_len,
            description="sequence s",
            style=style,
        ),
        "batch": widgets.IntSlider(batch, 1, 64, description="micro-batch b", style=style),
        "precision": widgets.Dropdown(
            options=["fp32", "mixed"], value="fp32", description="precision", style=style
        ),
    }
    device = widgets.Dropdown(
        options=list(DEVICES_GB), value="80 GB (H100)", description="device", style=style
    )
    readout = widgets.HTML()
    image = widgets.Image(format="png")

    def redraw():
        values = {name: w.value for name, w in controls.items()}
        if values["d_model"] % values["n_head"]:
            readout.value = (
                f"<b>width {values['d_model']} is not divisible by {values['n_head']} heads</b>"
            )
            return
        r = compute_memory_breakdown(**values)
        device_bytes = DEVICES_GB[device.value] * 1e9
        scale, unit = _unit(max(r["totals"]))
        readout.value = (
            f"{r['num_params']:,} parameters; micro-batch {values['batch']}: "
            f"total {r['totals'][-1] / 1e9:.3g} GB "
            f"({'fits' if r['totals'][-1] <= device_bytes else 'does NOT fit'} "
            f"in {device.value})"
        )

        def draw(ax):
            xs = [str(b) for b in r["batch_sizes"]]
            bottom = [0.0] * len(xs)
            for part in PARTS:
                heights = r[part] if part == "activations" else [r[part]] * len(xs)
                ax.bar(xs, [v / scale for v in heights], bottom=bottom, label=part)
                bottom = [b + v / scale for b, v in zip(bottom, heights)]
            if device_bytes <= 2 * max(r["totals"]):
                ax.axhline(device_bytes / scale, color="k", ls="--", label=device.value)
            else:
                ax.set_title(f"{device.value}: far above these bars", loc="right", fontsize=8)
            if measured and _matches(measured, values):
                ax.plot(
                    xs[r["batch_sizes"].index(measured["batch"])],
                    measured["bytes"] / scale,
                    "r*",
                    ms=16,
                    label="measured",
                )
            ax.set_xlabel("micro-batch size (sequences)")
            ax.set_ylabel(f"training memory ({unit})")
            ax.legend(fontsize=8)
            ax.set_title(f"training memory, {values['precision']}, Adam", loc="left")

        image.value = plot_png(draw, figsize=(7, 3.5))

    live([*controls.values(), device], redraw)
    return widgets.VBox(
        [
            widgets.HBox(
                [
                    widgets.VBox(list(controls.values())[:4]),
                    widgets.VBox([*list(controls.values())[4:], device]),
                ]
            ),
            readout,
            image,
        ]
    )


def _matches(measured: dict, values: dict) -> bool:
    cfg = measured["config"]
    same_model = all(
        getattr(cfg, k) == values[k]
        for k in ("n_layer", "d_model", "n_head", "vocab_size", "seq_len")
    )
    return (
        same_model
        and measured["precision"] == values["precision"]
        and measured["batch"] in _micro_batches(values["batch"])
    )
