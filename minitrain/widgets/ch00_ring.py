"""Widget of notebook 00: a token passed around a ring of ranks, measured live.

Pick the number of ranks and the message size; the ranks really run
``pass_the_token``-style send/recv and the timeline shows who waits for whom:
a ring pass is sequential, so its time grows with the number of ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minitrain.runtime import get_device, launch, trace
from minitrain.widgets import live, plot_png


def _ring_pass(numel: int, rounds: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    token = torch.zeros(numel, device=get_device())  # on a GPU node, NCCL carries it
    dist.barrier()
    for r in range(rounds):
        if world == 1:
            with trace.span(f"add (round {r})", "compute"):
                token += 1
            continue
        if rank == 0:
            with trace.span(f"add (round {r})", "compute"):
                token += 1
            with trace.span("send", "communication"):
                dist.send(token, 1)
            with trace.span("recv (waiting)", "idle"):
                dist.recv(token, world - 1)
        else:
            with trace.span("recv (waiting)", "idle"):
                dist.recv(token, rank - 1)
            with trace.span(f"add (round {r})", "compute"):
                token += rank + 1
            with trace.span("send", "communication"):
                dist.send(token, (rank + 1) % world)
    return token[0].item()


def measure_ring_pass(world_size: int, numel: int, rounds: int = 2):
    """Run ``rounds`` passes of a token of ``numel`` floats around ``world_size`` ranks.

    Returns ``(value on rank 0, per-rank trace events)``; the value must equal
    ``rounds * (1 + 2 + … + world_size)``.
    """
    out = launch(_ring_pass, world_size, numel, rounds, print_output=False, timeout=60)
    return out[0], out.traces


def build_ring_widget(default_world_size: int = 4):
    """Sliders for ranks and message size → re-measured ring pass, drawn as a timeline."""
    import ipywidgets as w

    ranks = w.IntSlider(value=default_world_size, min=1, max=4, description="ranks")
    size = w.Dropdown(
        options=[("4 B", 1), ("4 KB", 1024), ("4 MB", 1 << 20), ("40 MB", 10 << 20)],
        value=1024,
        description="message",
    )
    status = w.HTML()  # the numbers in words (also what headless tests read)
    image = w.Image(format="png")

    def redraw():
        value, traces = measure_ring_pass(ranks.value, size.value)
        expected = 2 * ranks.value * (ranks.value + 1) // 2
        span = max(e.end for evs in traces for e in evs) - min(
            e.start for evs in traces for e in evs
        )
        status.value = (
            f"{ranks.value} ranks, 2 rounds: token on rank 0 = {value:g} "
            f"(expected {expected}), {span * 1e3:.1f} ms"
        )
        image.value = plot_png(
            lambda ax: trace.plot_timeline(
                traces, ax=ax, title=f"token on rank 0: {value:g} (expected {expected})"
            ),
            figsize=(9, 0.8 + 0.45 * ranks.value),
        )

    live([ranks, size], redraw)
    return w.VBox([w.HBox([ranks, size]), status, image])
