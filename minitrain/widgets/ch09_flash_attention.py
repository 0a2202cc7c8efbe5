"""Widget of notebook 09: step through FlashAttention's tiles on a small example, and slide
the tile size to see the HBM traffic.

Used by notebooks/09_flash_attention.ipynb. ``trace_tiles`` runs the forward of
``minitrain.flash_attention.tiles`` tile by tile — the same pieces ``forward_query_block``
uses (``visible_key_blocks``, ``causal_mask``, ``online_softmax_update``) — and keeps, after
each tile, which Q/K/V blocks are "in SRAM", the running max and sum of each row and the
partial output. ``compute_tile_view`` (pure) says what one step shows, including at the last
tile of a query block how far its output is from the full softmax. ``compute_io_view`` gives
the IO count of a tile size: the formula of ``io_model`` next to what the tiled code records
(``TileLog``). Dao 2023, Algorithm 1; Dao et al. 2022, Theorem 2.
"""

from __future__ import annotations

import math

import torch

from minitrain.flash_attention.io_model import naive_io, tiled_io
from minitrain.flash_attention.tiles import (
    TileLog,
    blocks,
    causal_mask,
    flash_attention_forward,
    online_softmax_update,
    visible_key_blocks,
)
from minitrain.widgets import live, plot_png


def trace_tiles(n: int = 12, d: int = 4, block_q: int = 4, block_k: int = 4, causal: bool = True,
                seed: int = 0) -> dict:
    """Every tile the tiled forward computes, in order, with the running state after it."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(n, d, generator=g, device="cpu") for _ in range(3))
    s_full = q @ k.T / math.sqrt(d)
    if causal:
        s_full = s_full.masked_fill(torch.ones(n, n, dtype=torch.bool, device="cpu").triu(1), -math.inf)
    steps = []
    for i0, i1 in blocks(n, block_q):
        m = torch.full((i1 - i0,), -math.inf, device="cpu")
        row_sum, acc = torch.zeros(i1 - i0, device="cpu"), torch.zeros(i1 - i0, d, device="cpu")
        visit = visible_key_blocks(i0, i1, k, block_k, causal)
        for j0, j1 in visit:
            s = q[i0:i1] @ k[j0:j1].T / math.sqrt(d)
            mask = causal_mask(i0, i1, j0, j1) if causal else None
            if mask is not None:
                s = s.masked_fill(mask, -math.inf)
            m, row_sum, acc = online_softmax_update(m, row_sum, acc, s, v[j0:j1])
            steps.append({"q_block": (i0, i1), "k_block": (j0, j1), "max": m.clone(),
                          "sum": row_sum.clone(), "partial": acc / row_sum[:, None],
                          "last_of_block": (j0, j1) == visit[-1]})
    return {"n": n, "d": d, "block_q": block_q, "block_k": block_k, "causal": causal, "steps": steps,
            "reference": torch.softmax(s_full, -1) @ v, "reference_lse": torch.logsumexp(s_full, -1),
            "flash": flash_attention_forward(q, k, v, causal, block_q, block_k)[0]}


def compute_tile_view(trace: dict, step: int) -> dict:
    """What the widget shows at ``step`` (0-based): blocks in SRAM, per-row state, tile grid."""
    steps = trace["steps"]
    if not 0 <= step < len(steps):
        raise ValueError(f"step must be in [0, {len(steps) - 1}], got {step}")
    now = steps[step]
    (i0, i1), (j0, j1) = now["q_block"], now["k_block"]
    rows_q, rows_k = len(blocks(trace["n"], trace["block_q"])), len(blocks(trace["n"], trace["block_k"]))
    grid = [["skipped" if trace["causal"] and bj * trace["block_k"] > min((bi + 1) * trace["block_q"], trace["n"]) - 1
             else "pending" for bj in range(rows_k)] for bi in range(rows_q)]
    for past in steps[:step]:
        grid[past["q_block"][0] // trace["block_q"]][past["k_block"][0] // trace["block_k"]] = "done"
    grid[i0 // trace["block_q"]][j0 // trace["block_k"]] = "current"
    reference = trace["reference"][i0:i1]
    final_error = float((now["partial"] - reference).abs().max()) if now["last_of_block"] else None
    lse = now["max"] + torch.log(now["sum"])
    return {"step": step, "steps": len(steps), "in_sram": {"Q": (i0, i1), "K": (j0, j1), "V": (j0, j1)},
            "rows": list(range(i0, i1)), "max": now["max"].tolist(), "sum": now["sum"].tolist(),
            "partial": now["partial"], "reference": reference, "grid": grid,
            "last_of_block": now["last_of_block"], "final_error": final_error,
            "lse_error": float((lse - trace["reference_lse"][i0:i1]).abs().max()) if now["last_of_block"] else None}


def compute_io_view(n: int, d: int, block: int, causal: bool = False) -> dict:
    """HBM elements moved by the tiled forward with square tiles of ``block`` rows: the formula
    next to what ``flash_attention_forward`` records, the SRAM it needs (Q_i, K_j, V_j, O_i:
    4 block d elements, and the block x block score tile, which Dao et al. 2022's Algorithm 1
    counts too) and naive attention's traffic."""
    if block < 1:
        raise ValueError(f"block must be at least 1, got {block}")
    log = TileLog()
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(n, d, generator=g, device="cpu") for _ in range(3))
    flash_attention_forward(q, k, v, causal, block, block, log)
    formula = tiled_io(n, n, d, block, block, causal)
    return {"block": block, "sram_elements": 4 * block * d + block * block, "recorded": log.reads + log.writes,
            "formula": formula["total"], "naive": naive_io(n, d)["total"]}


def _describe(view: dict, io: dict) -> str:
    (i0, i1), (j0, j1) = view["in_sram"]["Q"], view["in_sram"]["K"]
    rows = "".join(f"<tr><td>{r}</td><td>{m:.3f}</td><td>{s:.3f}</td></tr>"
                   for r, m, s in zip(view["rows"], view["max"], view["sum"]))
    done = ""
    if view["last_of_block"]:
        done = (f"<br>last tile of rows {i0}-{i1 - 1}: output within {view['final_error']:.1e} of the full "
                f"softmax, logsumexp within {view['lse_error']:.1e}")
    return (f"<b>tile {view['step'] + 1} of {view['steps']}</b>: in SRAM Q[{i0}:{i1}], K[{j0}:{j1}], "
            f"V[{j0}:{j1}]<table><tr><th>row</th><th>running max</th><th>running sum</th></tr>{rows}"
            f"</table>{done}<br><b>tile size {io['block']}</b> (SRAM {io['sram_elements']} elements): "
            f"HBM traffic {io['recorded']:,} elements recorded, formula {io['formula']:,}; naive "
            f"{io['naive']:,}")


COLORS = {"done": 0.35, "current": 1.0, "pending": 0.0, "skipped": -1.0}


def plot_tile_view(view: dict, ax_grid=None, ax_out=None):
    """Tile grid (done / current / pending / skipped) and the partial output against the full."""
    import matplotlib.pyplot as plt

    if ax_grid is None:
        _, (ax_grid, ax_out) = plt.subplots(1, 2, figsize=(10, 3.2))
    ax_grid.imshow([[COLORS[c] for c in row] for row in view["grid"]], cmap="coolwarm", vmin=-1, vmax=1)
    ax_grid.set(title="tiles: red current, pale done, blue skipped", xlabel="key block j",
                ylabel="query block i")
    ax_out.plot(view["reference"].flatten(), "k.", label="full softmax output")
    ax_out.plot(view["partial"].flatten(), "rx", label="partial output (this query block)")
    ax_out.set(title=f"rows {view['rows'][0]}-{view['rows'][-1]}, all d columns", xlabel="row*d + column")
    ax_out.legend(fontsize=8)
    return ax_grid, ax_out


def build_flash_widget(trace: dict | None = None, step: int = 0, block: int = 4):
    """An ipywidgets VBox: a step slider through the tiles and a tile-size slider for the IO."""
    import ipywidgets as widgets

    trace = trace or trace_tiles()
    step_slider = widgets.IntSlider(value=step, min=0, max=len(trace["steps"]) - 1, description="tile")
    block_slider = widgets.IntSlider(value=block, min=1, max=trace["n"], description="tile size")
    readout, image = widgets.HTML(), widgets.Image(format="png")

    def redraw():
        view = compute_tile_view(trace, step_slider.value)
        io = compute_io_view(trace["n"], trace["d"], block_slider.value, trace["causal"])
        readout.value = _describe(view, io)
        image.value = plot_png(lambda axes: plot_tile_view(view, *axes), figsize=(10, 3.2), ncols=2)

    live([step_slider, block_slider], redraw)
    return widgets.VBox([widgets.HBox([step_slider, block_slider]), readout, image])
