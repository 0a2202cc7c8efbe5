"""Benchmark section: minitrain's tensor parallelism side by side with torch's own
(``torch.distributed.tensor.parallel``), with and without sequence parallelism.

Used by ``python -m minitrain.bench tp`` (minitrain/bench/tp.py); chapter 6
(notebooks/06_tensor_parallel.ipynb) quotes the ratio from a run. Target (issue 33): ≤ 1.0.

The same GPT (``minitrain.model.GPT``, one set of initial weights copied with
``copy.deepcopy`` before any sharding) is trained with AdamW on the same batches by
(a) ``minitrain.tensor_parallel.apply_tensor_parallel`` and (b) torch's ``parallelize_module``
over a 1-D ``init_device_mesh(device, (world,))`` with the declarative plan of torch's TP
tutorial (Megatron-LM's layout, Shoeybi et al. 2019, section 3; with SP, Korthikanti et al.
2022, section 4.2.2) — ``torch_plan`` below:

- attention: ``ColwiseParallel`` on each of q_proj, k_proj, v_proj, ``RowwiseParallel`` on
  out_proj. The course's attention has *separate* q/k/v Linears (not one fused qkv), so a
  column split of each keeps whole heads on each rank: rank r holds heads r·a/t .. (r+1)·a/t of
  q, k and v alike. The tutorial sets ``attn.n_heads = n_heads // tp`` here; the course's
  ``CausalSelfAttention`` reads the number of heads from the projected width (the local
  tensor, since Colwise returns it by default), so it runs a/t heads per rank with nothing
  to set — both do the same work;
- MLP: ``ColwiseParallel`` fc_in, ``RowwiseParallel`` fc_out;
- token embedding ``RowwiseParallel`` (vocabulary rows split, partial sums reduced), LM head
  ``ColwiseParallel`` with its logits left as a DTensor sharded on the vocabulary and the
  loss computed under ``loss_parallel()``: like minitrain's ``vocab_parallel_cross_entropy``,
  the logits are never gathered;
- with SP: ``SequenceParallel`` on ln_1, ln_2 and ln_f; ``PrepareModuleInput`` turns the
  sequence shards into a replicated input of attention and MLP (an all-gather); out_proj and
  fc_out reduce-scatter to ``Shard(1)``; the token embedding reduce-scatters too. The position
  table (the tutorial's Llama has none) is ``RowwiseParallel`` with output ``Shard(0)``: each
  rank gets the rows of its own positions, exact, as minitrain's
  ``SequenceParallelPositionEmbedding`` does (at the price of a reduce-scatter of s·h numbers).

Both take turns step by step (barrier, time, all-reduce MAX of the elapsed time: a step
takes as long as its slowest rank), step 0 warms up. Agreement: the loss of every step and
every full parameter after the last step — torch's DTensors gathered with ``.full_tensor()``,
minitrain's shards gathered along the dimension they are split on (the one where the shard's
shape differs from the dense parameter's) — and, sharper, the first step's gradients
(gathered the same way). ``moved`` says how far training took the parameters, so "agree" is
not trivially true. What to expect: gradients agree to ~1e-8; after ten AdamW steps the
parameters differ by up to ~1e-4 on the 3.3 M-parameter GPT, and each of the two differs from
a one-process run by the same order (measured): AdamW divides every gradient by its own root
mean square, so an element whose gradient is near its rounding error moves by up to lr in a
direction set by that rounding — most of all the key biases (``ZERO_GRADIENT``).
"""

from __future__ import annotations

import copy
import statistics

import torch
import torch.distributed as dist

from minitrain.bench import max_abs_difference
from minitrain.runtime import get_device, launch, slowest_rank_seconds

# The key projection's bias has a zero gradient in exact arithmetic (q·(k_j + b) adds the same
# q·b to every score of a row, and softmax ignores it), so its computed gradient is rounding
# noise (~1e-10) that AdamW divides by its own root mean square: an update of up to lr per step
# in a direction set by noise, different for two correct implementations summing in different
# orders. The benchmark reports the largest difference with and without it.
ZERO_GRADIENT = "attn.k_proj.bias"


def torch_plan(n_layer: int, sequence_parallel: bool) -> dict:
    """torch's declarative plan for the course's GPT: module path -> ParallelStyle."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    sp = sequence_parallel
    seq = Shard(1) if sp else Replicate()  # the residual stream between sub-blocks
    plan = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        # the logits stay a DTensor split on the vocabulary: loss_parallel() reads it so
        "head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                use_local_output=False),
    }
    if sp:
        plan["pos_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
        plan["ln_f"] = SequenceParallel()
    for i in range(n_layer):
        b = f"blocks.{i}"
        plan.update({
            f"{b}.attn.q_proj": ColwiseParallel(),  # this rank's heads (whole heads: see above)
            f"{b}.attn.k_proj": ColwiseParallel(),
            f"{b}.attn.v_proj": ColwiseParallel(),
            f"{b}.attn.out_proj": RowwiseParallel(output_layouts=seq),
            f"{b}.mlp.fc_in": ColwiseParallel(),
            f"{b}.mlp.fc_out": RowwiseParallel(output_layouts=seq),
        })
        if sp:  # LayerNorms on sequence shards; all-gather in front of attention and MLP
            for norm, sub in (("ln_1", "attn"), ("ln_2", "mlp")):
                plan[f"{b}.{norm}"] = SequenceParallel()
                plan[f"{b}.{sub}"] = PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def _full_parameters(model, dense_shapes: dict, group=None, grad: bool = False) -> dict:
    """name -> the full tensor (its gradient if ``grad``): a DTensor gathered, a minitrain
    shard all-gathered along the dimension its shape differs from the dense parameter's (rank
    r holds the r-th slice)."""
    full = {}
    for name, p in model.named_parameters():
        p = p.grad if grad else p.detach()
        if hasattr(p, "full_tensor"):  # torch's DTensor
            full[name] = p.full_tensor()
            continue
        diff = [d for d, (a, b) in enumerate(zip(p.shape, dense_shapes[name])) if a != b]
        if not diff:  # replicated
            full[name] = p
            continue
        parts = [torch.empty_like(p) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, p.contiguous(), group=group)
        full[name] = torch.cat(parts, dim=diff[0])
    return full


def _rank_peers(config: dict, steps: int, batch: int, sequence_parallel: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    from minitrain.model import GPT, GPTConfig, lm_loss
    from minitrain.tensor_parallel import apply_tensor_parallel

    device = get_device()
    torch.manual_seed(0)
    with torch.device(device):
        dense = GPT(GPTConfig(**config))
    ours = apply_tensor_parallel(copy.deepcopy(dense), sequence_parallel=sequence_parallel)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    theirs = parallelize_module(copy.deepcopy(dense), mesh,
                                torch_plan(config["n_layer"], sequence_parallel))
    models = {"minitrain": ours, "torch": theirs}
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}

    def minitrain_step(x, y):
        loss = ours.loss(x, y)
        loss.backward()
        return loss

    def torch_step(x, y):
        with loss_parallel():  # cross-entropy of vocabulary-sharded logits, and its backward
            loss = lm_loss(theirs(x), y)
            loss.backward()
        return loss

    run = {"minitrain": minitrain_step, "torch": torch_step}
    shapes, grads = {name: p.shape for name, p in dense.named_parameters()}, {}

    def train_step(name, x, y, capture_gradients: bool):
        loss = run[name](x, y)
        if capture_gradients:  # the gradients, before AdamW divides rounding noise by itself
            grads[name] = _full_parameters(models[name], shapes, grad=True)
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)
        return loss

    gen = torch.Generator(device="cpu").manual_seed(1)  # the same batches on every rank
    times = {name: [] for name in models}
    losses = {name: [] for name in models}
    for step in range(steps + 1):  # step 0 warms up both
        x, y = (torch.randint(0, config["vocab_size"], (batch, config["seq_len"]), generator=gen,
                              device="cpu").to(device) for _ in range(2))
        for name in models:  # the slowest rank's step
            seconds, loss = slowest_rank_seconds(train_step, name, x, y, step == 0, device=device)
            if step:
                times[name].append(seconds)
            loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
            losses[name].append(loss.item())
    full_ours, full_theirs = _full_parameters(ours, shapes), _full_parameters(theirs, shapes)
    diffs = {"loss": max(abs(a - b) for a, b in zip(losses["minitrain"], losses["torch"]))}
    for name in shapes:  # each parameter's own: the report names the worst
        diffs[name] = max_abs_difference({name: full_ours[name]}, full_theirs)
    grad_diff = max_abs_difference(grads["minitrain"], grads["torch"])
    moved = max_abs_difference(full_theirs, dict(dense.named_parameters()))
    # the same work: each rank holds the same share of the blocks (heads and MLP units split
    # alike; an unsharded attention in torch's plan would still compute the right numbers)
    local = {name: sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                       for pname, p in m.named_parameters() if pname.startswith("blocks."))
             for name, m in models.items()}
    return {"times": times, "diffs": diffs, "moved": moved, "block numel": local,
            "grad |diff|": grad_diff}


def run_variants(config: dict, steps: int, batch: int = 4, variants=(False, True),
                 world: int = 2) -> dict:
    """``run_peers`` for each ``sequence_parallel`` in ``variants``, in one launch (torch's
    DTensor machinery warms up once): {"TP" or "TP + SP": run_peers' dict}."""
    per_variant = launch(_rank_variants, world, config, steps, batch, tuple(variants),
                         timeout=1200)[0]
    results = {}
    for sp, r in zip(variants, per_variant):
        times = r["times"]
        ratios = [a / b for a, b in zip(times["minitrain"], times["torch"])]
        worst = max(r["diffs"], key=r["diffs"].get)
        elsewhere = [d for name, d in r["diffs"].items() if not name.endswith(ZERO_GRADIENT)]
        results["TP + SP" if sp else "TP"] = {
            "minitrain ms": 1e3 * statistics.median(times["minitrain"]),
            "torch ms": 1e3 * statistics.median(times["torch"]),
            "ratio": statistics.median(ratios), "max |diff|": r["diffs"][worst],
            "worst": worst, "loss |diff|": r["diffs"]["loss"],
            "|diff| elsewhere": max(elsewhere), "moved": r["moved"],
            "block numel": r["block numel"], "grad |diff|": r["grad |diff|"],
            "pairs": len(ratios)}
    return results


def _rank_variants(config, steps, batch, variants):
    return [_rank_peers(config, steps, batch, sp) for sp in variants]


def run_peers(config: dict, steps: int, batch: int = 4, sequence_parallel: bool = False,
              world: int = 2) -> dict:
    """Train ``GPT(config)`` ``steps`` (+1 warm-up) steps under minitrain's and torch's tensor
    parallelism, taking turns. Returns {"minitrain ms", "torch ms": median step times,
    "ratio": median of the per-step ratios minitrain / torch (below 1: minitrain faster),
    "max |diff|": the largest difference of a loss or a full parameter ("worst": which;
    "loss |diff|": the losses'; "|diff| elsewhere": the largest but on ``ZERO_GRADIENT``),
    "grad |diff|": the largest difference of the first step's gradients,
    "moved": the largest change of a parameter from its initial value, "pairs", "block numel":
    {"minitrain", "torch": the blocks' parameters one rank holds}}."""
    return next(iter(run_variants(config, steps, batch, (sequence_parallel,), world).values()))


def report_peers(results: dict) -> str:
    """One line per variant ("TP", "TP + SP") of ``run_peers``' results."""
    lines = []
    for name, r in results.items():
        lines.append(
            f"{name:<8} minitrain {r['minitrain ms']:7.1f} ms | torch {r['torch ms']:7.1f} ms | "
            f"ratio {r['ratio']:.2f}x (target <= 1.0, median of {r['pairs']} pairs) | "
            f"max |diff| {r['max |diff|']:.2e} ({r['worst']}), {r['|diff| elsewhere']:.2e} "
            f"without the k_proj biases, loss {r['loss |diff|']:.2e}, first gradients "
            f"{r['grad |diff|']:.2e}; parameters moved by up to {r['moved']:.2e}")
    return "\n".join(lines)
