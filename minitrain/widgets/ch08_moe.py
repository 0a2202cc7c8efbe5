"""Widget of notebook 08: where the tokens go — a heat-map of tokens per expert and rank from
a real forward pass of a trained MoE GPT, as the balancing method, the auxiliary-loss
weight, top-k and the capacity factor change; with the dropped fraction and the imbalance.

Used by notebooks/08_mixture_of_experts.ipynb. ``compute_routing_view`` is the pure function
behind it (unit tested): it trains the small MoE GPT for a short run with the chosen
balancing (``minitrain.moe.measure.train_load_history``; cached per choice), then routes a
held-out batch split over the ranks as data and expert parallelism split it
(``routing_table``). The capacity factor only changes that forward (dropping happens at
routing time), so it needs no new training run. Fedus et al. 2021 (capacity, the loss),
DeepSeek-AI 2024 (the bias).
"""

from __future__ import annotations

from minitrain.data import get_batch
from minitrain.moe.measure import SMALL_GPT, routing_table, train_load_history
from minitrain.widgets import live, plot_png

METHODS = ("aux_loss", "bias", "none")
_trained: dict = {}


def _model(balancing, aux_loss_weight, top_k, steps, num_experts):
    key = (balancing, aux_loss_weight if balancing == "aux_loss" else 0.0, top_k, steps,
           num_experts)
    if key not in _trained:
        history = train_load_history(balancing, key[1], steps=steps, num_experts=num_experts,
                                     top_k=top_k)
        _trained[key] = history
    return _trained[key]


def compute_routing_view(balancing: str = "aux_loss", aux_loss_weight: float = 0.01,
                         top_k: int = 1, capacity_factor: float | None = None, world: int = 2,
                         steps: int = 40, num_experts: int = 8, batch_size: int = 16) -> dict:
    """Train (cached), route a held-out batch over ``world`` ranks; returns the counts
    (ranks × experts) of the first MoE layer, the dropped fraction, the imbalance (max/mean
    load), the capacity per rank and expert, and the training run's imbalance curve."""
    if balancing not in METHODS:
        raise ValueError(f"balancing {balancing!r} is not one of {METHODS}")
    if batch_size % world:
        raise ValueError(f"batch_size={batch_size} is not divisible by {world} ranks")
    history = _model(balancing, aux_loss_weight, top_k, steps, num_experts)
    x, _ = get_batch(10_000, batch_size, vocab_size=SMALL_GPT["vocab_size"],
                     seq_len=SMALL_GPT["seq_len"])  # a step the run never trained on
    table = routing_table(history["model"], x, world, capacity_factor=capacity_factor)
    return {**table, "balancing": balancing, "aux_loss_weight": aux_loss_weight,
            "top_k": top_k, "capacity_factor": capacity_factor, "world": world,
            "training_imbalance": history["imbalance"]}


def describe(view: dict) -> str:
    cap = "no limit" if view["capacity_factor"] is None else f"{view['capacity']} per rank"
    return (f"{view['balancing']} (weight {view['aux_loss_weight']}) · top-{view['top_k']} · "
            f"capacity factor {view['capacity_factor']} ({cap}) — imbalance (max/mean load) "
            f"{view['imbalance']:.2f}, dropped {100 * view['dropped_fraction']:.1f} % of "
            "assignments")


def plot_view(view: dict, axes) -> None:
    import numpy as np

    ax1, ax2 = axes
    counts = np.array(view["counts"])
    im = ax1.imshow(counts, cmap="viridis", aspect="auto")
    ax1.set_xlabel("expert")
    ax1.set_ylabel("rank (its tokens)")
    ax1.set_yticks(range(counts.shape[0]))
    for (r, e), v in np.ndenumerate(counts):
        ax1.text(e, r, str(v), ha="center", va="center", color="w", fontsize="x-small")
    ax1.set_title("tokens routed (kept) per rank and expert", fontsize="small")
    ax1.figure.colorbar(im, ax=ax1)
    ax2.plot(view["training_imbalance"])
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set_xlabel("training step")
    ax2.set_ylabel("imbalance (max/mean)")
    ax2.set_title("imbalance during the training run", fontsize="small")


def build_moe_widget(world: int = 2, steps: int = 40, top_k: int = 2):
    """Controls (balancing method, aux-loss weight, top-k, capacity factor) → status line
    and heat-map. Each new (method, weight, top-k) trains once (a few seconds), then cached.
    ``top_k`` starts at 2, the k of notebook 08's balancing runs above the widget."""
    import ipywidgets as w

    method = w.ToggleButtons(options=list(METHODS), value="aux_loss", description="balancing")
    weight = w.SelectionSlider(options=[0.001, 0.01, 0.1], value=0.01,
                               description="aux weight")
    choice = w.ToggleButtons(options=[1, 2], value=top_k, description="top-k")
    # 0.0 stands for "no limit" (a SelectionSlider cannot hold None)
    capacity = w.SelectionSlider(options=[("none", 0.0), ("0.5", 0.5), ("1.0", 1.0),
                                          ("1.25", 1.25), ("2.0", 2.0)], value=0.0,
                                 description="capacity")
    status, image = w.HTML(), w.Image(format="png")

    def update():
        view = compute_routing_view(method.value, weight.value, choice.value,
                                    capacity.value or None, world, steps)
        status.value = describe(view)
        image.value = plot_png(lambda axes: plot_view(view, axes), (9, 3.0), ncols=2)

    live([method, weight, choice, capacity], update)
    return w.VBox([method, w.HBox([weight, capacity]), choice, status, image])
