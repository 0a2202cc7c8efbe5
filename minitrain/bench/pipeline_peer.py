"""Benchmark: minitrain's pipeline schedules against ``torch.distributed.pipelining``, side by side.

The 4th section of ``python -m minitrain.bench pipeline`` (alone: ``--peers-only``); chapter 7
(notebooks/07_pipeline_parallel.ipynb) quotes its ratios from a run. The course's GPT is cut
into p = 2 stages the same way for both (``minitrain.pipeline.split_blocks``: the embedding
and the first blocks on stage 0, the last blocks, ``ln_f``, the head and the loss on stage 1).
minitrain runs ``minitrain.pipeline.PipelineStage(...).train_step``; torch runs one
``torch.distributed.pipelining.PipelineStage`` per rank under a fresh ``ScheduleGPipe`` /
``Schedule1F1B`` per case (GPipe: Huang et al. 2019; 1F1B: Narayanan et al. 2021). Both start
from the same weights (deep copies of one GPT built with the same seed on every rank), take
the same batches (split into m micro-batches along the batch, ``chunk`` for both) and an SGD
step after each; they take turns step by step (who goes first alternates), each step's time
is the slowest rank's, step 0 warms up (gloo's connections, torch's shape inference).

The same objective for both: the mean over the m micro-batches of each micro-batch's mean
cross-entropy. minitrain's last stage divides each micro-batch's loss by m before its
backward; torch's schedule backpropagates each micro-batch's loss unscaled and divides the
accumulated gradients by m at the end (``scale_grads=True``, its default). SGD, not AdamW:
Adam's update hardly changes when a gradient is scaled, so it would hide a wrong scaling.
"""

from __future__ import annotations

import copy
import statistics

import torch
import torch.distributed as dist
from torch import nn

from minitrain.bench import max_abs_difference
from minitrain.runtime import get_device, launch, slowest_rank_seconds, trace

CASES = [("gpipe", 4), ("gpipe", 8), ("1f1b", 4), ("1f1b", 8)]  # (schedule, micro-batches)
LR = 0.1


class TorchStageModule(nn.Module):
    """Stage ``stage`` of the GPT for torch's ``PipelineStage``: the same blocks minitrain's
    stage holds, the embedding on the first stage, ``ln_f`` and the head on the last (it
    returns the logits; the schedule's ``loss_fn`` takes the loss). The parameters are the
    GPT's own objects, so ``gpt.named_parameters()`` names them as minitrain's stage does."""

    def __init__(self, gpt: nn.Module, blocks: range, first: bool, last: bool):
        super().__init__()
        self.tok_emb = gpt.tok_emb if first else None
        self.pos_emb = gpt.pos_emb if first else None
        self.blocks = nn.ModuleList(gpt.blocks[i] for i in blocks)
        self.ln_f = gpt.ln_f if last else None
        self.head = gpt.head if last else None

    def forward(self, x):
        if self.tok_emb is not None:  # the GPT's embed (no dropout: the benchmark's dropout is 0)
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return x if self.head is None else self.head(self.ln_f(x))


def _owned(stage) -> dict:
    """name -> parameter of what minitrain's stage holds (the dense model's names)."""
    return dict(stage.model.named_parameters())


def _step_minitrain(stage, opt, x, y, schedule, m):
    """One training step of minitrain's stage; returns the step's loss (every rank)."""
    loss = stage.train_step(x, y, schedule, m)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _step_torch(schedule, opt, x, y):
    """One training step of torch's schedule; returns the micro-batches' losses (the last
    stage's; an empty list elsewhere)."""
    rank, p, losses = dist.get_rank(), dist.get_world_size(), []
    if rank == 0:
        schedule.step(x)
    elif rank == p - 1:
        schedule.step(target=y, losses=losses, return_outputs=False)
    else:
        schedule.step()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return losses


def _rank(config: dict, cases: list, pairs: int, microbatch: int):
    from torch.distributed.pipelining import PipelineStage as TorchPipelineStage
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    from minitrain.model import GPT, GPTConfig, lm_loss
    from minitrain.pipeline import PipelineStage, make_schedule, split_blocks

    rank, p, device = dist.get_rank(), dist.get_world_size(), get_device()
    torch.manual_seed(0)
    with torch.device(device):
        dense = GPT(GPTConfig(**config))  # the same weights on every rank (same seed)
    torch_schedules = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    results = []
    for name, m in cases:
        ours = PipelineStage(copy.deepcopy(dense))  # keeps this rank's share in place
        theirs_gpt = copy.deepcopy(dense)
        blocks = split_blocks(config["n_layer"], p)[rank]
        module = TorchStageModule(theirs_gpt, blocks, rank == 0, rank == p - 1)
        theirs = torch_schedules[name](TorchPipelineStage(module, rank, p, device), m, loss_fn=lm_loss)
        schedule = make_schedule(name, p, m)
        opts = {"minitrain": torch.optim.SGD(ours.parameters(), lr=LR),
                "torch": torch.optim.SGD(module.parameters(), lr=LR)}
        gen = torch.Generator(device="cpu").manual_seed(1)  # the same batches on every rank
        times = {"minitrain": [], "torch": []}
        loss_diff = 0.0
        for step in range(pairs + 1):  # step 0 warms up both
            shape = (microbatch * m, config["seq_len"])
            x = torch.randint(0, config["vocab_size"], shape, generator=gen, device="cpu").to(device)
            y = torch.randint(0, config["vocab_size"], shape, generator=gen, device="cpu").to(device)
            steps = {"minitrain": (_step_minitrain, ours, opts["minitrain"], x, y, schedule, m),
                     "torch": (_step_torch, theirs, opts["torch"], x, y)}
            out = {}
            for who in ("minitrain", "torch") if step % 2 == 0 else ("torch", "minitrain"):
                trace.reset()  # minitrain's executor records its spans: keep the list short
                seconds, out[who] = slowest_rank_seconds(*steps[who], device=device)
                if step:
                    times[who].append(seconds)
            if rank == p - 1:  # torch's losses are per micro-batch, on the last stage only
                theirs_loss = torch.stack(out["torch"]).mean()
                loss_diff = max(loss_diff, (out["minitrain"] - theirs_loss).abs().item())
        owned, final = _owned(ours), dict(theirs_gpt.named_parameters())
        final = {pname: final[pname] for pname in owned}  # torch's copy of this rank's stage
        worst = max_abs_difference(owned, final)
        moved = max_abs_difference(final, dict(dense.named_parameters()))
        results.append(dict(times=times, param_diff=worst, loss_diff=loss_diff, moved=moved))
        dist.barrier()
    return results


def run_peers(config: dict, cases=CASES, pairs: int = 10, world: int = 2, microbatch: int = 4,
              timeout: float = 1200) -> dict:
    """Both pipelines on ``world`` ranks (gloo on the CPU), one launch for every case.

    ``cases``: (schedule name, micro-batches m) pairs, schedules "gpipe" and "1f1b"; the batch
    is ``microbatch * m`` sequences. Returns {(name, m): {"minitrain ms", "torch ms" (medians
    of ``pairs`` measured steps), "ratio" (median of the per-step ratios minitrain / torch),
    "max |diff|" (the parameters after the last step, and the losses of every step: the
    larger), "param diff", "loss diff", "moved" (how far the parameters moved from the
    initial weights)}}, each the largest over the ranks (each compares its own stage).
    """
    if pairs < 1:
        raise ValueError(f"run_peers: pairs must be at least 1, got {pairs!r}")
    ranks = launch(_rank, world, config, list(cases), pairs, microbatch, timeout=timeout)
    out = {}
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in ranks]
        times = per_rank[0]["times"]  # the slowest rank's already (all_reduce MAX)
        param_diff = max(r["param_diff"] for r in per_rank)
        loss_diff = max(r["loss_diff"] for r in per_rank)
        out[tuple(case)] = {
            "minitrain ms": 1e3 * statistics.median(times["minitrain"]),
            "torch ms": 1e3 * statistics.median(times["torch"]),
            "ratio": statistics.median([a / b for a, b in zip(times["minitrain"], times["torch"])]),
            "max |diff|": max(param_diff, loss_diff),
            "param diff": param_diff,
            "loss diff": loss_diff,
            "moved": max(r["moved"] for r in per_rank),
        }
    return out


def report(results: dict, pairs: int) -> str:
    """The table ``python -m minitrain.bench pipeline`` prints for ``run_peers``' results."""
    lines = [f"{'schedule':<10}{'m':>3}{'minitrain ms':>14}{'torch ms':>10}{'ratio':>8}"
             f"{'max |param diff|':>18}{'max |loss diff|':>17}{'moved':>10}"]
    for (name, m), r in results.items():
        lines.append(f"{name:<10}{m:>3}{r['minitrain ms']:>14.1f}{r['torch ms']:>10.1f}"
                     f"{r['ratio']:>7.2f}x{r['param diff']:>18.2e}{r['loss diff']:>17.2e}"
                     f"{r['moved']:>10.2e}")
    worst = max(r["ratio"] for r in results.values())
    lines.append(f"ratio = median of {pairs} per-step ratios minitrain / torch (below 1: faster); "
                 f"target <= 1.05: {'met' if worst <= 1.05 else 'NOT met'} (worst {worst:.2f}x)")
    return "\n".join(lines)
