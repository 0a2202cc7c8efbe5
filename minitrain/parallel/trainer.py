"""The trainer of chapter 11: one rank's step on a device mesh, apart from the parallelization.

Chapter 11, notebooks/11_putting_it_together.ipynb; ``python -m minitrain.train`` calls it.
``parallelize`` (``parallelize.py``) turns the dense GPT into this rank's share of a layout;
``ParallelGPT`` does what a training loop does with it: the batching (this data-parallel rank's
rows, this context-parallel rank's tokens and their positions), micro-batches and gradient
accumulation, the pipeline's step, the loss averaged over the replicas, and the state a
checkpoint needs to continue bit-exactly; ``set_lr`` (the schedule's rate) and ``evaluate``
(the held-out loss, ``evaluation.py``).

Every rank starts from the same dense model (same seed), so each rank's shards are slices of
the single-process model: the loss curve is the single process's, within float rounding.
The global batch is fixed; data-parallel rank r takes its rows of each global micro-batch
(``local_rows``), every tensor-parallel (and pipeline) rank of a replica reads the same. The
model lives on ``get_device()``; the data is generated on the CPU (its generator) and moved.
Between backward and the update, ``grad_norm.GradientStep`` unscales (fp16), agrees on a
skip, measures the global norm and clips; ``last_metrics`` holds ``grad_norm`` (``loss_scale``).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from minitrain.checkpointing import get_rng_state, set_rng_state
from minitrain.data import MarkovChainData
from minitrain.ddp import DataParallel
from minitrain.model import GPT, GPTConfig
from minitrain.moe import moe_layers, set_aux_loss_scale
from minitrain.parallel.evaluation import held_out_loss, set_optimizer_lr
from minitrain.parallel.grad_norm import GradientStep, owned_parameters, owned_zero_shards
from minitrain.parallel.mesh import DeviceMesh, check_layout
from minitrain.parallel.parallelize import (
    check_composition,
    full_layout,
    parallelize,
)
from minitrain.pipeline import average_gradients
from minitrain.precision import MasterWeightOptimizer
from minitrain.runtime import get_device, trace
from minitrain.tensor_parallel.random import load_rng_state_dict, rng_state_dict
from minitrain.zero import ZeroDataParallel


class ParallelGPT:
    """One rank's share of the GPT on a mesh, its optimizer, and ``step(step_index)``.

    ``layout``: dict with dp, tp, pp, cp, zero (0–3), microbatches, schedule ("gpipe" or
    "1f1b"), sequence_parallel, checkpointing, optimizer, precision (``full_layout``).
    ``clip_grad_norm`` > 0 clips the global gradient norm to it. ``step`` returns
    the global mean loss of that step (the same number on every rank), exactly what one
    process computes on the whole batch. ``state()`` / ``load_state()`` (or ``state_dict()`` /
    ``load_state_dict()``) save and restore everything a bit-exact continuation needs.
    ``data``: what ``get_batch(step, batch_size, rank, world_size, device=, held_out=)``
    is called on (``minitrain.data.TextData``, or by default the synthetic
    ``MarkovChainData`` of the config and seed); ``eval_batches``: held-out batches
    ``evaluate`` averages.
    """

    def __init__(self, config: GPTConfig, layout: dict, batch_size: int, lr: float, seed: int,
                 mesh: DeviceMesh | None = None, *, data=None, eval_batches: int = 4,
                 clip_grad_norm: float = 0.0):
        if not clip_grad_norm >= 0:
            raise ValueError(f"clip_grad_norm must be >= 0 (0: off), got {clip_grad_norm!r}")
        self.config, self.batch_size, self.seed = config, batch_size, seed
        self.device = get_device()
        if data is None:
            with torch.device("cpu"):  # the data lives on the CPU; batches are moved
                data = MarkovChainData(config.vocab_size, config.seq_len, seed)
        self.data = data
        if self.data.vocab_size != config.vocab_size or self.data.seq_len != config.seq_len:
            raise ValueError(f"the data has vocab_size {self.data.vocab_size} and seq_len "
                             f"{self.data.seq_len}, the model {config.vocab_size} and "
                             f"{config.seq_len}")
        if eval_batches < 1:
            raise ValueError(f"eval_batches must be positive, got {eval_batches}")
        self.eval_batches = eval_batches
        self.layout = lo = full_layout(layout)
        check_layout(config, lo["dp"], lo["tp"], lo["pp"], lo["cp"], config.seq_len,
                     batch_size, lo["microbatches"])
        check_composition(config, lo)  # refused before any group is built
        self.mesh = mesh or DeviceMesh(dp=lo["dp"], tp=lo["tp"], pp=lo["pp"], cp=lo["cp"],
                                       ep=lo["ep"])
        torch.manual_seed(seed)  # the same dense model on every rank
        with torch.device("cpu"):  # initialised on the CPU (the same numbers on every device)
            dense = GPT(config)
        dense = dense.to(self.device)
        parts = parallelize(dense, self.mesh, lo, lr=lr, seed=seed)
        self.model, self.wrapped, self.optimizer = parts.model, parts.wrapped, parts.optimizer
        self.stage, self.context, self.loss_fn = parts.stage, parts.context, parts.loss_fn
        self.dp_group, self.replicas, self.scaler = parts.dp_group, parts.replicas, parts.scaler
        self.masters = isinstance(self.optimizer, MasterWeightOptimizer)
        self.last_metrics: dict = {}  # this step's extra log fields, merged by the command
        self.experts = parts.experts  # expert parallelism's gradient averaging, or None
        self.moe_layers = moe_layers(self.model)
        if isinstance(self.wrapped, ZeroDataParallel):  # it steps its inner optimizer itself
            grads = owned_zero_shards(self.wrapped.live_units(), self.wrapped.rank,
                                      parts.dense_numels, parts.tp_group)
            self.gradient_step = GradientStep(grads, clip_grad_norm, self.scaler)
            self.wrapped.optimizer.register_step_pre_hook(self.gradient_step.pre_hook)
        else:
            self.gradient_step = GradientStep(self.stepped_gradients(parts), clip_grad_norm,
                                              self.scaler)

    def stepped_gradients(self, parts):
        """The fp32 tensors the optimizer steps (masters, or the parameters), by dense name."""
        name_of = {id(p): n for n, p in self.model.named_parameters()}
        if self.masters:
            pairs = zip(self.optimizer.model_params, self.optimizer.master_params)
        else:
            pairs = ((p, p) for g in self.optimizer.param_groups for p in g["params"])
        named = [(name_of[id(p)], stepped, p.numel()) for p, stepped in pairs]
        if parts.experts is None:
            return owned_parameters(named, parts.dense_numels, parts.tp_group, self.dp_group)
        experts = {name_of[id(p)] for p in parts.experts.params}
        return owned_parameters(named, parts.dense_numels, parts.tp_group, self.dp_group,
                                experts, parts.experts.group)

    def local_rows(self) -> torch.Tensor:
        """This data-parallel rank's rows of the global batch, as indices into it, in the order
        its local batch holds them: sharded *micro-batch first*. Global micro-batch j is rows
        [j·B/M, (j+1)·B/M) on every layout (M = ``microbatches``), and data-parallel rank r
        holds the r-th of its D contiguous slices; so ``x.chunk(M)[j]`` of the local batch is
        this rank's part of global micro-batch j, and the D ranks' parts of micro-batch j
        together are one process's micro-batch j (the routers' balancing statistics, counted
        over ``dp_cp`` per micro-batch, are one process's: chapter 8)."""
        b, m, d = self.batch_size, self.layout["microbatches"], self.layout["dp"]
        per = b // (m * d)  # check_layout: B is a multiple of M·D
        r = self.mesh.coords().dp
        starts = torch.arange(m, device="cpu") * (b // m) + r * per
        return (starts[:, None] + torch.arange(per, device="cpu")).reshape(-1)

    def local_batch(self, step: int, held_out: bool = False):
        """This data-parallel rank's rows (``local_rows``) of the global batch of ``step`` (of
        the held-out set's batch ``step`` with ``held_out``), on the model's device."""
        with torch.device("cpu"):  # generated by its CPU generator, then moved
            x, y = self.data.get_batch(step, self.batch_size, held_out=held_out)
            rows = self.local_rows()
            x, y = x[rows], y[rows]
        x, y = x.to(self.device), y.to(self.device)
        if self.context is not None:  # and this context-parallel rank's tokens of it
            x, y = self.context.shard(x), self.context.shard(y)
        return x, y

    def step(self, step: int) -> float:
        """One optimizer step on the global batch of ``step``; the global mean loss."""
        x, y = self.local_batch(step)
        # where this rank's tokens sit in the sequence: 0..s-1, or its CP shard's (chapter 10)
        pos = None if self.context is None else self.context.positions(x)
        m = self.layout["microbatches"]
        # layout-free dropout: micro-batch j's masks keyed by its global rows (minitrain.dropout)
        keys = self.model.dropout_keys.micro_batches(self.seed, step, self.local_rows(), m, pos, x)
        # fp16: the loss functions multiply by S; the logged loss is divided back (exact: 2^k)
        scale = 1.0 if self.scaler is None else self.scaler.get_scale()
        self.optimizer.zero_grad()
        if self.stage is not None:
            total = self.stage.train_step(x, y, self.layout["schedule"], m, positions=pos,
                                          dropout_keys=keys)
            if self.replicas > 1:  # DP's once-per-step average, traced: the timeline shows it
                with trace.span("all-reduce gradients (DP)", "communication", self.device):
                    average_gradients(self.stage.parameters(), self.dp_group)
                    if self.masters:  # fp32 masters' gradients, averaged in fp32
                        average_gradients(self.optimizer.master_params, self.dp_group)
        else:
            total = 0.0
            aux = torch.zeros((), device=x.device)  # the routers' balancing losses, for the log
            set_aux_loss_scale(self.model, 1.0 / m)  # chapter 8: the aux loss in backward, 1/M
            chunks = list(zip(x.chunk(m), y.chunk(m)))
            for i, (xi, yi) in enumerate(chunks):
                # gradient accumulation: only the last micro-batch's backward synchronises
                last = i == len(chunks) - 1
                accumulate = isinstance(self.wrapped, DataParallel) and not last
                sync = self.wrapped.no_sync() if accumulate else nullcontext()
                self.model.dropout_keys.current = keys[i]
                with sync:
                    loss = self.loss_fn(self.wrapped(xi, positions=pos), yi) / m
                    loss.backward()
                total += loss.detach().float()
                for layer in self.moe_layers:  # Switch's N·Σ f·P of this micro-batch, unweighted
                    aux = aux + layer.router.balance_loss.float() / m
            if self.experts is not None:  # the experts' gradients over expert_dp (chapter 8)
                self.experts.average()
        self.model.dropout_keys.current = None  # no stale key for a forward outside a step
        if isinstance(self.wrapped, ZeroDataParallel):
            self.optimizer.step()  # the pre-hook unscales, agrees, measures and clips
        else:
            self.gradient_step.step(self.optimizer)
        # the step's numbers, read by the host once (on a GPU each .item() waits for the queue):
        # the loss and the routers' Switch loss averaged over DP × CP in one all-reduce, the
        # global norm (already the mesh's), the loss scale (a host float)
        total = torch.as_tensor(total, device=self.device).reshape(())
        means = [total]
        if self.moe_layers:
            means.append(aux.reshape(()).to(total.dtype))
        means = self.reduce_means(torch.stack(means))
        metrics = dict(self.gradient_step.metrics)
        norm = metrics.pop("grad_norm", None)
        scalars = torch.cat([means, norm.reshape(1).to(means)] if norm is not None else [means])
        host = scalars.tolist()  # the one host synchronisation of a step
        if norm is not None:
            metrics["grad_norm"] = host[-1]
        if self.moe_layers:  # the global mean, the same number on every rank
            metrics["aux_loss"] = host[1]
        self.last_metrics = metrics
        return host[0] / scale

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next ``step``, on whatever optimizer this layout uses
        (``evaluation.set_optimizer_lr``)."""
        set_optimizer_lr(self.optimizer, lr)

    def evaluate(self) -> float:
        """The mean loss over the fixed held-out set (``eval_batches`` global batches): no
        dropout, no gradient, no step, the RNG untouched; the same on every layout."""
        return held_out_loss(self, self.eval_batches)

    def reduce_means(self, local: torch.Tensor) -> torch.Tensor:
        """The mean of each element over data- and context-parallel ranks (TP ranks already
        agree): one all-reduce (every rank holds as many tokens); a new tensor, on the device."""
        t = local.detach().clone()
        if self.replicas > 1:
            dist.all_reduce(t, group=self.dp_group)
            t /= self.replicas
        return t

    def reduce_loss(self, local: torch.Tensor) -> float:
        """``reduce_means`` of one number, read by the host."""
        return self.reduce_means(local.reshape(1)).item()

    def state(self) -> dict:
        """What a checkpoint must hold to continue bit-exactly: weights, fp32 masters,
        optimizer, loss scale, RNG."""
        out = {"model": self.model_state(), "rng": get_rng_state(self.generator_devices()),
               "tp_rng": rng_state_dict(self.model)}  # TP dropout's per-rank streams
        if isinstance(self.wrapped, ZeroDataParallel):  # its shards and its inner optimizer
            out["shards"] = [u.master.detach().clone() for u in self.wrapped.live_units()]
            # and the buffers, which no unit holds (a router's DeepSeek-V3 bias and load)
            out["buffers"] = {n: b.detach().clone() for n, b in self.model.named_buffers()}
            out["optimizer"] = self.wrapped.optimizer.state_dict()
        elif self.masters:  # the fp32 masters keep digits the bf16/fp16 model cannot hold
            out["masters"] = [p.detach().clone() for p in self.optimizer.master_params]
            out["optimizer"] = self.optimizer.optimizer.state_dict()
        else:
            out["optimizer"] = self.optimizer.state_dict()
        if self.scaler is not None:
            out["scaler"] = self.scaler.state_dict()
        return out

    def generator_devices(self) -> list:
        """The accelerators whose generators this rank may draw from besides the CPU's: saved
        and restored with the CPU's, or a resumed run's random numbers would restart there.
        The trainer's dropout draws from none (its masks are keyed: ``minitrain.dropout``), but
        anything else random on the device does (a module's own ``rand_like``, sampling)."""
        return [] if self.device.type == "cpu" else [self.device]

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
                    u.shard.copy_(saved)  # rounded to the compute dtype, if one
            self.wrapped.optimizer.load_state_dict(state["optimizer"])
            self.wrapped.refresh_from_shards()  # the module's parameters from the shards
            with torch.no_grad():
                for name, b in self.model.named_buffers():
                    b.copy_(state.get("buffers", {}).get(name, b))
        elif self.masters:
            self.model.load_state_dict(state["model"])
            with torch.no_grad():
                for master, saved in zip(self.optimizer.master_params, state["masters"]):
                    master.copy_(saved)
            self.optimizer.optimizer.load_state_dict(state["optimizer"])
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        rng = state["rng"]  # every generator the run draws from (an old file: the CPU's)
        set_rng_state(rng if isinstance(rng, dict) else {"cpu": rng})
        load_rng_state_dict(self.model, state.get("tp_rng", {}))

    def state_dict(self) -> dict:
        """``state()``, under the name torch's modules and optimizers give it."""
        return self.state()

    def load_state_dict(self, state: dict) -> None:
        """``load_state(state)``, under the name torch's modules and optimizers give it."""
        self.load_state(state)

