"""Widgets of notebook 02: a float explorer and a loss-scale slider over real gradients.

- Float explorer: pick a format, flip its bits and read the value; or type a number and see
  the nearest representable value, its neighbours and the rounding error (minitrain.precision).
- Loss-scale slider: the gradients of one real backward pass of the tiny GPT (weights and the
  activations flowing between layers), drawn on a log2 axis against fp16's range, with the
  fraction that would flush to zero (or overflow) at the chosen loss scale.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import nn

from minitrain.precision import FORMATS, FP16, FloatFormat
from minitrain.widgets import live, plot_png

# ------------------------------------------------------------------ float explorer


def compute_float_explorer(format_name: str, bits: int | None = None, value: float | None = None):
    """What the explorer shows for a bit pattern (`bits`) or a typed number (`value`).

    Returns a dict: bits (int), bit_string "s|eeeee|mmmmmmmmmm", the sign/exponent/mantissa
    fields, kind (zero, subnormal, normal, inf, nan), value (the decoded pattern), and, for a
    typed value, the nearest representable value, its two neighbours and the rounding error.
    """
    if format_name not in FORMATS:
        raise ValueError(f"unknown format {format_name!r}; choose one of {sorted(FORMATS)}")
    if (bits is None) == (value is None):
        raise ValueError("give exactly one of bits= or value=")
    fmt = FORMATS[format_name]
    if bits is None:
        bits = fmt.encode(value)
    decoded = fmt.decode(bits)
    e, m = fmt.exponent_bits, fmt.mantissa_bits
    sign, exponent, mantissa = bits >> (e + m), (bits >> m) & ((1 << e) - 1), bits & ((1 << m) - 1)
    s = format(bits, f"0{fmt.bits}b")
    if math.isnan(decoded):
        kind = "nan"
    elif math.isinf(decoded):
        kind = "inf"
    elif decoded == 0:
        kind = "zero"
    else:
        kind = "subnormal" if exponent == 0 else "normal"
    out = dict(
        format=fmt.name,
        bits=bits,
        bit_string=f"{s[0]}|{s[1 : 1 + e]}|{s[1 + e :]}",
        sign=sign,
        exponent=exponent,
        mantissa=mantissa,
        kind=kind,
        value=decoded,
    )
    if value is not None:
        out["typed"] = float(value)
        out["nearest"] = decoded
        if math.isfinite(decoded):
            out["neighbours"] = fmt.neighbours(decoded)
            out["abs_error"] = abs(decoded - value)
            out["rel_error"] = abs(decoded - value) / abs(value) if value else 0.0
    return out


def _describe(info: dict) -> str:
    lines = [
        f"<b>{info['format']}</b> bits <code>{info['bit_string']}</code> = {info['bits']:#x}",
        f"sign {info['sign']}, exponent field {info['exponent']}, mantissa field "
        f"{info['mantissa']} ({info['kind']})",
        f"value: <b>{info['value']!r}</b>",
    ]
    if "typed" in info:
        lines.append(f"typed {info['typed']!r} -> nearest {info['nearest']!r}")
        if "neighbours" in info:
            lo, hi = info["neighbours"]
            lines.append(f"neighbours: {lo!r} below, {hi!r} above")
            lines.append(
                f"rounding error: {info['abs_error']:.3g} (relative {info['rel_error']:.3g})"
            )
    return "<br>".join(lines)


def bit_fields(fmt: FloatFormat) -> list[tuple[str, int]]:
    """(field, bit index) of every bit, most significant first: the sign, E exponent bits,
    M mantissa bits; index 0 is the last mantissa bit. What labels the explorer's toggles."""
    n = fmt.bits
    fields = ["sign"] + ["exponent"] * fmt.exponent_bits + ["mantissa"] * fmt.mantissa_bits
    return [(field, n - 1 - i) for i, field in enumerate(fields)]


def field_legend(fmt: FloatFormat) -> str:
    """One HTML line naming the toggles: which bit indices are sign, exponent, mantissa."""
    n, e = fmt.bits, fmt.exponent_bits
    return (
        f"bits {n - 1}…0, most significant first: <span style='color:#d9534f'>sign</span> "
        f"(bit {n - 1}) · <span style='color:#f0ad4e'>exponent</span> (bits {n - 2}…{n - 1 - e}) · "
        f"<span style='color:#5bc0de'>mantissa</span> (bits {fmt.mantissa_bits - 1}…0)<br>"
    )


def build_float_explorer(format_name: str = "fp16", value: float = 0.1):
    """Dropdown (format), one toggle per bit, a number box; the HTML shows the decoding."""
    import ipywidgets as w

    fmt_box = w.Dropdown(options=list(FORMATS), value=format_name, description="format")
    number = w.FloatText(value=value, description="value")
    bit_row = w.HBox()
    status = w.HTML()
    busy = {"now": False}  # setting toggles from code must not re-trigger the handlers

    def show(info):
        status.value = field_legend(FORMATS[fmt_box.value]) + _describe(info)
        busy["now"] = True
        for i, button in enumerate(bit_row.children):
            button.value = bool((info["bits"] >> (len(bit_row.children) - 1 - i)) & 1)
        busy["now"] = False

    def make_bits():
        fmt = FORMATS[fmt_box.value]
        buttons = []
        for field, index in bit_fields(fmt):
            colour = {"sign": "danger", "exponent": "warning", "mantissa": "info"}[field]
            b = w.ToggleButton(
                value=False,
                button_style=colour,
                description=str(index),  # the bit's index, most significant first
                tooltip=f"{field} bit {index}",
                layout=w.Layout(width="34px"),
            )
            buttons.append(b)
        bit_row.children = buttons
        live(buttons, on_bit, now=False)

    def on_bit():
        if busy["now"]:
            return
        bits = 0
        for button in bit_row.children:
            bits = (bits << 1) | int(button.value)
        show(compute_float_explorer(fmt_box.value, bits=bits))

    def on_value():
        show(compute_float_explorer(fmt_box.value, value=number.value))

    def on_format():
        make_bits()
        on_value()

    live([number], on_value, now=False)
    live([fmt_box], on_format)
    return w.VBox([w.HBox([fmt_box, number]), bit_row, status])


# ------------------------------------------------------------------ gradients vs fp16's range


def collect_gradients(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, scale=1.0):
    """One backward pass of `model.loss(idx, targets) * scale`; returns {name: gradient}, for
    every parameter and for the output of every nn.Linear (the activation gradients, which
    backward passes from layer to layer and which fp16 flushes first)."""
    outputs = {}

    def keep(name):
        def hook(module, inputs, output):
            output.retain_grad()
            outputs[name] = output

        return hook

    handles = [
        mod.register_forward_hook(keep(name))
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear)
    ]
    try:
        model.zero_grad(set_to_none=True)
        (model.loss(idx, targets) * scale).backward()
    finally:
        for h in handles:
            h.remove()
    grads = {f"{n} (weight grad)": p.grad.detach() for n, p in model.named_parameters()}
    grads.update({f"{n} (activation grad)": o.grad.detach() for n, o in outputs.items()})
    return grads


@lru_cache(maxsize=4)
def tiny_gpt_gradients(batch_size: int = 16, seed: int = 0) -> torch.Tensor:
    """All fp32 gradient values (weights and activations) of the freshly initialised tiny GPT
    on one batch of the course's Markov-chain data, flattened."""
    from minitrain.data import MarkovChainData
    from minitrain.model import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig())
    idx, targets = MarkovChainData().get_batch(0, batch_size)
    grads = collect_gradients(model, idx, targets)
    return torch.cat([g.flatten().float() for g in grads.values()])


def compute_gradient_histogram(grads: torch.Tensor, scale: float, fmt=FP16, bins: int = 60):
    """Histogram of log2|g * scale| for the nonzero gradients `grads`, and what `fmt` does to
    them: flushed (nonzero, rounds to 0), subnormal (below min_normal: fewer significant bits),
    overflow (rounds to inf, or saturates for E4M3fn). Fractions are of the nonzero values."""
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale!r}")
    g = grads[grads != 0].float() * scale
    rounded = fmt.round(g)
    a = g.abs()
    log2 = torch.log2(a.clamp(min=1e-45))
    lo = min(math.log2(fmt.min_subnormal) - 8, float(log2.min()))
    hi = max(math.log2(fmt.max) + 4, float(log2.max()) + 1)
    counts, edges = torch.histogram(log2.double(), bins=bins, range=(lo, hi))
    return dict(
        counts=counts.tolist(),
        edges=edges.tolist(),
        n=g.numel(),
        flushed_fraction=float((rounded == 0).double().mean()),
        subnormal_fraction=float(((a < fmt.min_normal) & (rounded != 0)).double().mean()),
        # E4M3fn saturates instead of overflowing: count what was clamped to +-max
        overflow_fraction=float((rounded.isinf() if fmt.has_inf else a > fmt.max).double().mean()),
        log2_min_subnormal=math.log2(fmt.min_subnormal),
        log2_min_normal=math.log2(fmt.min_normal),
        log2_max=math.log2(fmt.max),
    )


def plot_gradient_histogram(h: dict, ax, title: str = ""):
    """Draw `compute_gradient_histogram`'s result: bars, and shaded flush/overflow regions."""
    edges, counts = h["edges"], h["counts"]
    ax.bar(edges[:-1], counts, width=edges[1] - edges[0], align="edge", color="tab:blue")
    ax.axvspan(
        edges[0], h["log2_min_subnormal"] - 1, color="tab:red", alpha=0.25, label="flushes to 0"
    )
    ax.axvspan(
        h["log2_min_subnormal"] - 1,
        h["log2_min_normal"],
        color="tab:orange",
        alpha=0.2,
        label="subnormal",
    )
    ax.axvspan(h["log2_max"], edges[-1], color="tab:purple", alpha=0.25, label="overflow")
    ax.set_xlabel("log2 |gradient × scale| (binary exponent; 0 means 1.0)")
    ax.set_ylabel("gradient values (count per bin)")
    ax.set_title(
        title or f"flushed {h['flushed_fraction']:.2%}, overflow {h['overflow_fraction']:.2%}"
    )
    ax.legend(loc="upper left", fontsize=8)


def build_loss_scale_widget(grads: torch.Tensor | None = None, log2_scale: int = 0):
    """Slider of log2(loss scale) and a format choice -> histogram and flushed fraction."""
    import ipywidgets as w

    grads = tiny_gpt_gradients() if grads is None else grads
    slider = w.IntSlider(value=log2_scale, min=0, max=32, description="log2 scale")
    fmt_box = w.Dropdown(options=["fp16", "bf16", "fp8_e5m2"], value="fp16", description="format")
    status = w.HTML()
    image = w.Image(format="png")

    def redraw():
        fmt = FORMATS[fmt_box.value]
        h = compute_gradient_histogram(grads, 2.0**slider.value, fmt)
        status.value = (
            f"loss scale 2^{slider.value}: {h['flushed_fraction']:.2%} of {h['n']} nonzero "
            f"gradient values flush to zero in {fmt.name}, {h['subnormal_fraction']:.2%} are "
            f"subnormal, {h['overflow_fraction']:.2%} overflow"
        )
        image.value = plot_png(lambda ax: plot_gradient_histogram(h, ax), figsize=(8, 3))

    live([slider, fmt_box], redraw)
    return w.VBox([w.HBox([slider, fmt_box]), status, image])
