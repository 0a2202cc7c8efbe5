"""Widget of notebook 11: the layout planner — model size, devices, memory, bandwidth → the
ranked layouts that fit, with their memory and step-time bars.

Used by notebooks/11_putting_it_together.ipynb. ``compute_plan`` is the pure function behind
it (unit tested): it builds a GPT shape of roughly the chosen size (Megatron-LM's Table 1
shapes, Narayanan et al. 2021) and calls ``minitrain.parallel.plan``; the bars are the
planner's own parts (params, grads, optimizer, activations; compute, bubble, TP, CP, PP, DP).
"""

from __future__ import annotations

import html

from minitrain.model import GPTConfig
from minitrain.parallel import MEGATRON_2021, Cluster, a100_cluster, plan
from minitrain.widgets import live

MODELS = {name: (heads, h, layers) for name, heads, h, layers, *_ in MEGATRON_2021}
MEMORY_PARTS = ("params", "grads", "optimizer", "activations")
TIME_PARTS = ("compute", "bubble", "tp", "cp", "pp", "dp")
COLORS = dict(zip(MEMORY_PARTS + TIME_PARTS, ["#4C72B0", "#DD8452", "#55A868", "#C44E52",
                                              "#4C72B0", "#8172B2", "#DD8452", "#937860",
                                              "#DA8BC3", "#55A868"]))


def compute_plan(model: str, devices: int, memory_gb: float, intra_gbs: float, inter_gbs: float,
                 seq_len: int = 2048, batch: int = 512, top: int = 6) -> dict:
    """The planner's ranking for a Megatron-LM Table 1 model on an A100-like cluster with the
    chosen devices, memory and bandwidths: {"config", "rows", "considered"}."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {list(MODELS)}")
    heads, h, layers = MODELS[model]
    config = GPTConfig(vocab_size=51200, seq_len=seq_len, n_layer=layers, n_head=heads, d_model=h)
    base = a100_cluster(devices)
    cluster = Cluster(devices, min(base.devices_per_node, devices), memory_gb * 1e9,
                      intra_gbs * 1e9, inter_gbs * 1e9, base.peak_flops, base.mfu)
    rows = plan(config, seq_len, batch, cluster, top=None,
                zero_stages=(0, 1, 3), checkpointing=("none", "full"))
    return {"config": config, "rows": rows[:top], "considered": len(rows), "cluster": cluster}


def _bar(parts: dict, keys, scale: float, unit: float) -> str:
    cells = "".join(
        f'<span title="{k}: {parts[k] / unit:.3g}" style="display:inline-block;height:10px;'
        f'width:{max(0.0, 220 * parts[k] / scale):.1f}px;background:{COLORS[k]}"></span>'
        for k in keys)
    return f'<span style="white-space:nowrap">{cells}</span>'


def describe(view: dict) -> str:
    """An HTML table: one row per layout, memory (GB) and time (s) with stacked bars."""
    rows = view["rows"]
    if not rows:
        return "<b>No layout fits</b>: more devices, more memory or a smaller model."
    mem_scale = view["cluster"].memory_per_device
    time_scale = max(r["time"]["total"] for r in rows)
    lines = [f"<b>{view['considered']} layouts fit</b>; fastest first "
             f"(memory bar: {' '.join(MEMORY_PARTS)}; time bar: {' '.join(TIME_PARTS)})",
             "<table><tr><th>layout</th><th>GB/device</th><th></th><th>s/step</th><th></th></tr>"]
    for r in rows:
        mem, t = r["memory"], r["time"]
        lines.append(
            f"<tr><td>{html.escape(str(r['layout']))}</td><td>{mem['total'] / 1e9:.1f}</td>"
            f"<td>{_bar(mem, MEMORY_PARTS, mem_scale, 1e9)}</td><td>{t['total']:.2f}</td>"
            f"<td>{_bar(t, TIME_PARTS, time_scale, 1.0)}</td></tr>")
    return "\n".join(lines + ["</table>"])


def build_planner_widget():
    """Controls (model, devices, memory, bandwidths) → the ranked table."""
    import ipywidgets as w

    model = w.Dropdown(options=list(MODELS), value="18.4B", description="model")
    devices = w.Dropdown(options=[8, 16, 32, 64, 128, 256, 512], value=256, description="devices")
    memory = w.IntSlider(value=80, min=16, max=192, step=8, description="GB/device")
    intra = w.IntSlider(value=300, min=25, max=900, step=25, description="intra GB/s")
    inter = w.IntSlider(value=25, min=3, max=100, step=1, description="inter GB/s")
    status = w.HTML()

    def update():
        status.value = describe(compute_plan(model.value, devices.value, memory.value,
                                             intra.value, inter.value))

    live([model, devices, memory, intra, inter], update)
    return w.VBox([w.HBox([model, devices]), w.HBox([memory, intra, inter]), status])
