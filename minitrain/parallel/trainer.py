"""The course's GPT on a device mesh: chapters 4–7 and 10 composed, none re-implemented.

Chapter 11, notebooks/11_putting_it_together.ipynb; ``python -m minitrain.train`` calls it.
Each technique wraps the model from the inside out, each over its own mesh group:

1. tensor (+sequence) parallelism splits every block's matrices over ``mesh.group("tp")``
   (chapter 6, ``apply_tensor_parallel``: Shoeybi et al. 2019; Korthikanti et al. 2022);
2. pipeline parallelism gives each ``pp`` coordinate a contiguous share of the blocks and
   runs a GPipe or 1F1B schedule of micro-batches (chapter 7, ``minitrain.pipeline``);
3. context parallelism gives each ``cp`` rank a zigzag shard of every sequence and ring
   attention over ``mesh.group("cp")`` (chapter 10, ``ContextParallelGPT``; Liu et al. 2023);
4. data parallelism averages gradients over ``mesh.group("dp_cp")`` (chapter 4's
   ``DataParallel``), or shards optimizer state, gradients, parameters (chapter 5's
   ``ZeroDataParallel``, stages 1–3: Rajbhandari et al. 2020).

Every rank starts from the same dense model (same seed), so each rank's shards are slices of
the single-process model: the loss curve is the single process's, within float rounding.
The global batch is fixed; ``minitrain.data.get_batch`` hands data-parallel rank r its
rows, and every tensor-parallel (and pipeline) rank of a data-parallel replica reads the same.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from minitrain.checkpointing import set_checkpointing
from minitrain.context_parallel import ContextParallelGPT
from minitrain.data import get_batch
from minitrain.ddp import DataParallel
from minitrain.mesh import DeviceMesh, check_layout
from minitrain.model import GPT, GPTConfig, lm_loss
from minitrain.pipeline import PipelineStage
from minitrain.tensor_parallel import apply_tensor_parallel, vocab_parallel_cross_entropy
from minitrain.tensor_parallel.random import load_rng_state_dict, rng_state_dict
from minitrain.zero import ShardedOptimizer, ZeroDataParallel

# "sgd" (lr = 1 in the tests) shows a constant error in a gradient's scale, which AdamW's
# m / sqrt(v) cancels: a sum instead of a mean, a LayerNorm gradient counted t times
OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


class ParallelGPT:
    """One rank's share of the GPT on a mesh, its optimizer, and ``step(step_index)``.

    ``layout``: dict with dp, tp, pp, cp, zero (0–3), microbatches, schedule ("gpipe" or
    "1f1b"), sequence_parallel, checkpointing, optimizer (``full_layout``). ``step`` returns the global mean loss of that step (the same
    number on every rank), exactly what one process computes on the whole batch.
    """

    def __init__(self, config: GPTConfig, layout: dict, batch_size: int, lr: float, seed: int,
                 mesh: DeviceMesh | None = None):
        self.config, self.batch_size, self.seed = config, batch_size, seed
        self.layout = full_layout(layout)
        lo = self.layout
        check_layout(config, lo["dp"], lo["tp"], lo["pp"], lo["cp"], config.seq_len,
                     batch_size, lo["microbatches"])
        if lo["sequence_parallel"] and (config.seq_len // lo["cp"]) % lo["tp"]:
            raise ValueError(f"sequence parallelism cuts each rank's {config.seq_len // lo['cp']} "
                             f"positions (seq_len {config.seq_len} / cp {lo['cp']}) over "
                             f"tp={lo['tp']} ranks: they must divide evenly")
        if lo["pp"] > 1 and lo["zero"] > 1:
            raise ValueError(
                f"zero={lo['zero']} with pp={lo['pp']}: ZeRO-2/3 shard gradients and parameters "
                "that every micro-batch of a pipeline needs again (Megatron-LM and DeepSpeed do "
                "not combine them either); use --zero 0 or 1 with a pipeline")
        self.mesh = mesh or DeviceMesh(dp=lo["dp"], tp=lo["tp"], pp=lo["pp"], cp=lo["cp"])
        # gradients are averaged over DP and CP together (each CP rank's loss covers its
        # tokens only; Megatron-LM folds CP into the data-parallel reduction the same way)
        self.dp_group, self.tp_group = self.mesh.group("dp_cp"), self.mesh.group("tp")
        self.replicas = lo["dp"] * lo["cp"]
        torch.manual_seed(seed)  # the same dense model on every rank
        model = GPT(config)
        if lo["tp"] > 1:  # with SP and CP, SP cuts this CP rank's shard further (Megatron-Core)
            apply_tensor_parallel(model, self.tp_group, lo["sequence_parallel"], seed=seed)
        self.model, self.stage, self.context = model, None, None
        if lo["cp"] > 1:  # chapter 10: ring attention, this rank's zigzag shard of each sequence
            self.context = ContextParallelGPT(model, self.mesh.group("cp"), layout="zigzag")
            # the model's own embed (called by TP's forward and the pipeline's first stage)
            # must look positions up where this rank's tokens sit: use chapter 10's
            model.embed = self.context.embed
        recompute = "full" if lo["checkpointing"] == "full" else None
        opt_cls = OPTIMIZERS[lo["optimizer"]]
        if lo["pp"] > 1:  # chapter 7: keep this stage's blocks, gradients averaged over dp
            self.stage = PipelineStage(model, self.mesh.group("pp"), checkpointing=recompute)
            params = [p for p in model.parameters() if p.requires_grad]
            self.wrapped = self.stage
            if lo["zero"] == 1:  # chapter 5's ZeRO-1 under the pipeline's averaged gradients
                self.optimizer = ShardedOptimizer(params, opt_cls, group=self.dp_group, lr=lr)
            else:
                self.optimizer = opt_cls(params, lr=lr)
            return
        if recompute:  # chapter 3: every block recomputed in backward
            set_checkpointing(model, recompute)
        if lo["zero"] == 0:
            self.wrapped = DataParallel(model, group=self.dp_group) if self.replicas > 1 \
                else model
            self.optimizer = opt_cls(model.parameters(), lr=lr)
        else:
            self.wrapped = ZeroDataParallel(model, opt_cls, lo["zero"], group=self.dp_group,
                                            lr=lr)
            self.optimizer = self.wrapped  # step() and zero_grad() of its own

    def loss_fn(self, logits, targets):
        if self.layout["tp"] > 1:  # this rank holds a vocabulary slice of the logits
            return vocab_parallel_cross_entropy(logits, targets, self.tp_group)
        return lm_loss(logits, targets)

    def local_batch(self, step: int):
        """This data-parallel rank's rows of the global batch of ``step``."""
        c = self.config
        x, y = get_batch(step, self.batch_size, self.mesh.coords().dp, self.layout["dp"],
                         vocab_size=c.vocab_size, seq_len=c.seq_len, seed=self.seed)
        if self.context is not None:  # and this context-parallel rank's tokens of it
            x, y = self.context.shard(x), self.context.shard(y)
        return x, y

    def step(self, step: int) -> float:
        """One optimizer step on the global batch of ``step``; the global mean loss."""
        x, y = self.local_batch(step)
        m = self.layout["microbatches"]
        self.optimizer.zero_grad(set_to_none=True)
        if self.stage is not None:
            dp = self.dp_group if self.replicas > 1 else None
            loss = self.stage.train_step(x, y, self.layout["schedule"], m, dp_group=dp)
            self.optimizer.step()
            return self.reduce_loss(loss)
        total = 0.0
        chunks = list(zip(x.chunk(m), y.chunk(m)))
        for i, (xi, yi) in enumerate(chunks):
            # gradient accumulation: only the last micro-batch's backward synchronises
            last = i == len(chunks) - 1
            accumulate = isinstance(self.wrapped, DataParallel) and not last
            sync = self.wrapped.no_sync() if accumulate else nullcontext()
            with sync:
                loss = self.loss_fn(self.wrapped(xi), yi) / m
                loss.backward()
            total += loss.detach()
        self.optimizer.step()
        return self.reduce_loss(total)

    def reduce_loss(self, local: torch.Tensor) -> float:
        """The mean over data- and context-parallel ranks (TP ranks already agree): one fp32
        all-reduce (every rank holds as many tokens)."""
        t = local.detach().reshape(1).clone()
        if self.replicas > 1:
            dist.all_reduce(t, group=self.dp_group)
            t /= self.replicas
        return t.item()

    def state(self) -> dict:
        """What a checkpoint must hold to continue bit-exactly: weights, optimizer, RNG."""
        out = {"model": self.model_state(), "rng": torch.get_rng_state(),
               "tp_rng": rng_state_dict(self.model)}  # TP dropout's per-rank streams
        if isinstance(self.wrapped, ZeroDataParallel):  # its shards and its inner optimizer
            out["shards"] = [u.master.detach().clone() for u in self.wrapped.live_units()]
            out["optimizer"] = self.wrapped.optimizer.state_dict()
        else:
            out["optimizer"] = self.optimizer.state_dict()
        return out

    def model_state(self) -> dict:
        """The weights this rank holds. Under ZeRO the shards (``state()["shards"]``) are
        the weights and the module holds no tensor of its own: stage 3's parameters are
        views of freed storage (saving them writes empty storages, a file no one can load),
        so nothing of the module is saved; without ZeRO its ``state_dict()``."""
        if isinstance(self.wrapped, ZeroDataParallel):
            return {}
        return self.model.state_dict()

    def load_state(self, state: dict) -> None:
        if isinstance(self.wrapped, ZeroDataParallel):
            with torch.no_grad():
                for u, saved in zip(self.wrapped.live_units(), state["shards"]):
                    u.master.copy_(saved)
                    u.shard.copy_(saved)
            self.wrapped.optimizer.load_state_dict(state["optimizer"])
            self.wrapped.refresh_from_shards()  # the module's parameters from the shards
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        load_rng_state_dict(self.model, state.get("tp_rng", {}))


def full_layout(layout: dict) -> dict:
    """The layout with every key: dp, tp, pp, cp (1), zero (0), microbatches (1), schedule
    ("1f1b"), sequence_parallel (False), checkpointing ("none" or "full": every block
    recomputed, chapter 3), optimizer ("adamw" or "sgd"). A planner ``Layout``'s fields are
    these keys (``minitrain.planner.layout_dict``)."""
    out = {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "zero": 0, "microbatches": 1,
           "schedule": "1f1b", "sequence_parallel": False, "checkpointing": "none",
           "optimizer": "adamw"}
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
    return out


def single_process_losses(config: GPTConfig, steps: int, batch_size: int, lr: float,
                          seed: int, first_step: int = 0, optimizer: str = "adamw") -> list[float]:
    """The reference: the dense GPT, AdamW (or ``optimizer``), the whole global batch, one
    process."""
    torch.manual_seed(seed)
    model = GPT(config)
    opt = OPTIMIZERS[optimizer](model.parameters(), lr=lr)
    losses = []
    for step in range(first_step, first_step + steps):
        x, y = get_batch(step, batch_size, vocab_size=config.vocab_size, seq_len=config.seq_len,
                         seed=seed)
        opt.zero_grad(set_to_none=True)
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
