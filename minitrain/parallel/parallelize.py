"""``parallelize(model, mesh, layout)``: chapters 3–8 and 10 applied to one GPT, each over its group.

Chapter 11, notebooks/11_putting_it_together.ipynb (``ParallelGPT`` in ``trainer.py`` calls it).
As torchtitan composes a model (``parallelize_llama``: apply TP, then AC, then data parallel),
the composition is a sequence of functions, each taking the mesh group of its axis and
changing the model only through the chapters' public entry points — no class swapped here, no
method overwritten:

1. ``apply_tensor_parallel`` (chapter 6) splits every block's matrices over ``mesh.group("tp")``
   (Shoeybi et al. 2019; with sequence parallelism Korthikanti et al. 2022);
2. ``apply_context_parallel`` (chapter 10) puts ring attention over ``mesh.group("cp")`` in every
   block (Liu et al. 2023); the shard's positions reach the GPT as an argument
   (``model(idx, positions=...)``), which the trainer passes on every forward;
3. ``apply_expert_parallel`` (chapter 8) spreads each MoE layer's experts over ``mesh.group("ep")``
   (GShard, Lepikhin et al. 2020) and makes every router count its load over the whole
   batch (``mesh.group("dp_cp")``), so the balancing loss is one process's;
4. ``apply_pipeline`` (chapter 7) keeps this ``pp`` coordinate's share of the blocks;
   full recomputation (chapter 3) is applied per stage chunk, or to the whole model;
5. ``apply_data_parallel`` (chapters 4–5) averages gradients over ``mesh.group("dp_cp")``
   (DDP) or shards optimizer state, gradients, parameters (ZeRO 1–3, Rajbhandari et al. 2020);
   an expert-parallel rank's own experts are left out of it and averaged over
   ``mesh.group("expert_dp")`` instead (``ExpertGradients``);
   with ``precision`` bf16/fp16 it computes in that dtype on fp32 masters (chapter 2's
   ``MasterWeightOptimizer``, or chapter 5's ``ZeroDataParallel(compute_dtype=)``), and
   ``apply_precision`` computes the loss in fp32 (fp16: times chapter 2's loss scale).

Gradients of CP ranks are averaged with the DP ones, in one reduction over DP × CP: each CP
rank's loss covers its tokens only (Megatron-LM folds CP into its data-parallel group the same way).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from minitrain import moe
from minitrain.checkpointing import set_checkpointing
from minitrain.context_parallel import ContextParallelGPT
from minitrain.ddp import DataParallel
from minitrain.model import GPT, lm_loss
from minitrain.parallel.mesh import DeviceMesh
from minitrain.pipeline import PipelineStage
from minitrain.precision import DynamicLossScaler, MasterWeightOptimizer
from minitrain.tensor_parallel import apply_tensor_parallel, vocab_parallel_cross_entropy
from minitrain.zero import ShardedOptimizer, ZeroDataParallel

# "sgd" (lr = 1 in the tests) shows a constant error in a gradient's scale, which AdamW's
# m / sqrt(v) cancels: a sum instead of a mean, a LayerNorm gradient counted t times
OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
# --precision: the dtype forward and backward compute in (masters and optimizer stay fp32)
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Parallelized:
    """What ``parallelize`` hands the trainer: this rank's share of the model and how to step it."""

    model: GPT  # this rank's share: its TP slices, its pipeline stage's blocks
    wrapped: nn.Module  # what a step calls: the model, DataParallel, ZeroDataParallel or the stage
    optimizer: object  # steps this rank's parameters (under ZeRO 1–3, the wrapper itself)
    loss_fn: Callable  # (logits, targets) -> mean loss; vocab-parallel under TP
    dp_group: ProcessGroup | None  # gradients and logged losses are averaged over it (DP × CP)
    replicas: int  # its size
    stage: PipelineStage | None = None
    context: ContextParallelGPT | None = None  # shards a batch, says where its tokens sit
    scaler: DynamicLossScaler | None = None  # fp16: the loss is scaled by it (loss_fn does)
    dense_numels: dict | None = None  # name -> elements in the dense GPT (a smaller one: TP split)
    tp_group: ProcessGroup | None = None
    experts: ExpertGradients | None = None  # expert parallelism's own gradient averaging


def full_layout(layout: dict) -> dict:
    """The layout with every key: dp, tp, pp, cp (1), zero (0), microbatches (1), schedule
    ("1f1b"), sequence_parallel (False), checkpointing ("none" or "full": every block
    recomputed, chapter 3), optimizer ("adamw" or "sgd"), precision ("fp32", "bf16" or
    "fp16": the compute dtype; masters and optimizer state stay fp32), ep (1: the
    expert-parallel size, inside dp × cp). A planner ``Layout``'s fields are these keys
    (``minitrain.parallel.layout_dict``)."""
    out = {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 0, "microbatches": 1,
           "schedule": "1f1b", "sequence_parallel": False, "checkpointing": "none",
           "optimizer": "adamw", "precision": "fp32"}
    unknown = set(layout) - set(out)
    if unknown:
        raise ValueError(f"unknown layout keys {sorted(unknown)}; expected {sorted(out)}")
    out.update(layout)
    if out["zero"] not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {out['zero']!r}")
    if out["schedule"] not in ("gpipe", "1f1b"):
        raise ValueError(f"schedule must be 'gpipe' or '1f1b', got {out['schedule']!r}")
    if out["checkpointing"] not in ("none", "full"):
        raise ValueError(f"checkpointing must be 'none' or 'full', got {out['checkpointing']!r}")
    if out["optimizer"] not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, "
                         f"got {out['optimizer']!r}")
    if out["precision"] not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, "
                         f"got {out['precision']!r}")
    return out


def check_composition(config, lo: dict) -> None:
    """What the techniques refuse together, as one clear error (``check_layout`` has the
    divisibilities of each axis alone)."""
    if lo["sequence_parallel"] and (config.seq_len // lo["cp"]) % lo["tp"]:
        raise ValueError(f"sequence parallelism cuts each rank's {config.seq_len // lo['cp']} "
                         f"positions (seq_len {config.seq_len} / cp {lo['cp']}) over "
                         f"tp={lo['tp']} ranks: they must divide evenly")
    check_moe_composition(config, lo)
    if lo["pp"] > 1 and lo["zero"] > 1:
        raise ValueError(
            f"zero={lo['zero']} with pp={lo['pp']}: ZeRO-2/3 shard gradients and parameters "
            "that every micro-batch of a pipeline needs again (Megatron-LM and DeepSpeed do "
            "not combine them either); use --zero 0 or 1 with a pipeline")


def check_moe_composition(config, lo: dict) -> None:
    """Mixture of experts and expert parallelism: what they need, and what is refused."""
    ep, experts = lo["ep"], getattr(config, "moe_experts", 0)
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"--ep {ep!r} must be a whole number ≥ 1")
    if ep > 1 and not experts:
        raise ValueError(f"--ep {ep} needs experts to spread: set --moe-experts")
    if (lo["dp"] * lo["cp"]) % ep:
        raise ValueError(f"--ep {ep} does not divide dp × cp = {lo['dp'] * lo['cp']}")
    if experts and experts % ep:
        raise ValueError(f"--moe-experts {experts} is not divisible by --ep {ep}")
    if not experts:
        return
    for flag, on in (("--pp", lo["pp"] > 1), ("--sequence-parallel", lo["sequence_parallel"])):
        if on:  # one line naming the flags: not built (yet), rather than built wrong
            raise ValueError(f"--moe-experts with {flag}: not supported (mixture of experts "
                             "composes with --dp, --tp, --cp, --zero and --ep)")
    if ep > 1 and lo["zero"]:  # ZeRO would shard different ranks' experts as one tensor
        raise ValueError(f"--ep {ep} with --zero {lo['zero']}: not supported (ZeRO shards "
                         "over dp × cp, where expert-parallel ranks hold different experts); "
                         "use --zero 0 with --ep")


class ExpertGradients:
    """Expert parallelism's gradient rule (chapter 8 over the mesh's groups).

    An expert's gradient arrives through the all-to-all's backward as the *sum* over the ep
    ranks whose tokens it served; the ranks holding the same experts (``expert_dp``) each
    have such a sum. The gradient of the mean loss over dp × cp ranks is then their sum over
    ``expert_dp`` divided by dp × cp: one flat all-reduce after backward. Data parallelism
    leaves these parameters alone (``DataParallel(ignored_params=...)``).

    Summed in ``promote_types(dtype, fp32)``; with fp32 masters the average goes to them
    (``deliver_to``: DDP's averaged-gradient hook never reaches these parameters)."""

    def __init__(self, params: list, group: ProcessGroup | None, replicas: int):
        self.params, self.group, self.replicas = params, group, replicas
        self.masters = None  # a MasterWeightOptimizer taking the averages (deliver_to)

    def deliver_to(self, masters) -> None:  # each average to masters.add_gradient, not .grad
        self.masters = masters

    @torch.no_grad()
    def average(self) -> None:
        acc = torch.promote_types(self.params[0].dtype, torch.float32)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1).to(acc) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat /= self.replicas
        offset = 0
        for p in self.params:
            average = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            if self.masters is not None:
                self.masters.add_gradient(p, average)
                p.grad = None
            else:
                p.grad = average.to(p.dtype)


def apply_expert_parallel(model: GPT, mesh: DeviceMesh, ep: int) -> ExpertGradients | None:
    """Chapter 8 over the mesh: every router counts its load over ``dp_cp`` (the batch's
    ranks); with ep > 1, chapter 8's ``apply_expert_parallel`` keeps this rank's share of
    each layer's experts, exchanging tokens over ``mesh.group("ep")``. Under TP each TP rank
    routes the same tokens to the same experts (the experts are replicated over tp). Returns
    the experts' gradient rule (None with ep = 1: they are replicated like the rest)."""
    if ep > 1:
        moe.apply_expert_parallel(model, mesh.group("ep"))
    layers = moe.moe_layers(model)
    dp_cp = mesh.group("dp_cp")
    if dist.get_world_size(dp_cp) > 1:
        for layer in layers:
            layer.router.token_group = dp_cp
    if ep == 1:
        return None
    params = [p for layer in layers for p in layer.experts.parameters()]
    return ExpertGradients(params, mesh.group("expert_dp"), dist.get_world_size(dp_cp))


def apply_context_parallel(model: GPT, group: ProcessGroup | None,
                           layout: str = "zigzag") -> ContextParallelGPT:
    """Chapter 10 over ``group``: ring attention in every block (with TP + SP, each TP rank
    cuts this CP rank's shard further, as Megatron-Core does). Returns chapter 10's
    ``ContextParallelGPT``, whose ``shard(x)`` cuts a batch and ``positions(x)`` says where
    this rank's tokens sit; the model itself is called with those positions."""
    return ContextParallelGPT(model, group, layout=layout)


def apply_pipeline(model: GPT, group: ProcessGroup | None, checkpointing=None) -> PipelineStage:
    """Chapter 7 over ``group``: this stage keeps its blocks (and the embeddings or the head);
    ``checkpointing`` (chapter 3's policy) is applied to each of its chunks."""
    return PipelineStage(model, group, checkpointing=checkpointing)


def apply_data_parallel(model: GPT, group: ProcessGroup | None, zero: int, optimizer_cls,
                        lr: float, stage: PipelineStage | None = None, compute_dtype=None,
                        ignored_params=()):
    """Chapters 4–5 over ``group`` (the mesh's ``dp_cp``); returns (what a step calls, the
    optimizer). Under a pipeline the trainer averages gradients once per step, after the
    stage's ``train_step`` (traced), and ZeRO-1 shards the optimizer state; without one, DDP
    (``zero=0``, nothing to do on one replica) or ``ZeroDataParallel`` (stages 1–3, an
    optimizer of its own). ``ignored_params`` (expert parallelism's experts) are left out of
    DDP's averaging. ``compute_dtype`` (bf16/fp16): the model computes in it and the
    optimizer steps fp32 masters — ``ZeroDataParallel(compute_dtype=)`` shards them; otherwise
    chapter 2's ``MasterWeightOptimizer`` (on the DDP wrapper, so masters get the average;
    under a pipeline the trainer averages the masters' fp32 gradients)."""
    make = optimizer_cls
    if stage is not None and zero == 1:  # chapter 5's ZeRO-1 under the pipeline's averaging
        def make(params, **kw):
            return ShardedOptimizer(params, optimizer_cls, group=group, **kw)
    if zero > 0 and stage is None:
        wrapped = ZeroDataParallel(model, optimizer_cls, zero, group=group, lr=lr,
                                   compute_dtype=compute_dtype)
        return wrapped, wrapped  # step() and zero_grad() of its own
    module = stage if stage is not None else model
    if compute_dtype is not None:
        # the masters are the fp32 weights themselves, not their rounded low-precision copy
        fp32 = [p.detach().clone() for p in module.parameters() if p.requires_grad]
        module.to(compute_dtype)
    wrapped = module
    if stage is None and dist.get_world_size(group) > 1:
        wrapped = DataParallel(model, group=group, ignored_params=ignored_params)
    if compute_dtype is None:
        return wrapped, make([p for p in module.parameters() if p.requires_grad], lr=lr)
    optimizer = MasterWeightOptimizer(wrapped, make, lr=lr)
    with torch.no_grad():
        for master, weight in zip(optimizer.master_params, fp32):
            master.copy_(weight)
    return wrapped, optimizer


def apply_precision(model: GPT, loss_fn: Callable, precision: str):
    """bf16/fp16: the loss from fp32 logits (as autocast computes cross-entropy in fp32);
    fp16: times chapter 2's ``DynamicLossScaler`` scale S, so small fp16 gradients survive
    (Micikevicius et al. 2018, §3.2) — the trainer unscales. Sets ``model.loss_fn`` (what a
    pipeline's last stage calls) too; returns (loss_fn, scaler or None)."""
    if precision == "fp32":
        return loss_fn, None
    scaler = DynamicLossScaler() if precision == "fp16" else None

    def wrap(fn):
        def loss(logits, targets):
            value = fn(logits.float(), targets)
            return value if scaler is None else scaler.scale(value)
        return loss

    model.loss_fn = wrap(getattr(model, "loss_fn", lm_loss))
    return wrap(loss_fn), scaler


def parallelize(model: GPT, mesh: DeviceMesh, layout: dict, lr: float = 1e-3,
                seed: int | None = None) -> Parallelized:
    """Make the dense ``model`` (the same on every rank: same seed) this rank's share of
    ``layout`` over ``mesh``, in place: TP, CP, PP (with recomputation), then DP. ``lr`` is
    the optimizer's, ``seed`` seeds TP's per-rank dropout stream (default: torch's)."""
    lo, config = full_layout(layout), model.config
    check_composition(config, lo)
    dense_numels = {name: p.numel() for name, p in model.named_parameters()}
    dp_group, tp_group = mesh.group("dp_cp"), mesh.group("tp")
    loss_fn = lm_loss
    if lo["tp"] > 1:  # with SP and CP, SP cuts this CP rank's shard further (Megatron-Core)
        apply_tensor_parallel(model, tp_group, lo["sequence_parallel"], seed=seed)
        loss_fn = functools.partial(vocab_parallel_cross_entropy, group=tp_group)  # vocab slice
    context = apply_context_parallel(model, mesh.group("cp")) if lo["cp"] > 1 else None
    experts = apply_expert_parallel(model, mesh, lo["ep"]) if config.moe_experts else None
    recompute = "full" if lo["checkpointing"] == "full" else None
    stage = apply_pipeline(model, mesh.group("pp"), recompute) if lo["pp"] > 1 else None
    if recompute and stage is None:  # chapter 3: every block recomputed in backward
        set_checkpointing(model, recompute)
    loss_fn, scaler = apply_precision(model, loss_fn, lo["precision"])
    wrapped, optimizer = apply_data_parallel(model, dp_group, lo["zero"], OPTIMIZERS[lo["optimizer"]],
                                             lr, stage, PRECISIONS[lo["precision"]],
                                             experts.params if experts else ())
    if experts is not None and isinstance(optimizer, MasterWeightOptimizer):
        experts.deliver_to(optimizer)  # the experts' averages to their fp32 masters
    return Parallelized(model, wrapped, optimizer, loss_fn, dp_group,
                        dist.get_world_size(dp_group), stage, context, scaler, dense_numels,
                        tp_group, experts)
