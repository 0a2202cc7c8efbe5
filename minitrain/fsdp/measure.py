"""What FSDP costs, measured and predicted: bytes per rank, peak gathered bytes, bytes sent —
and, on a modeled link, the time prefetching hides (``measure_prefetch``, issue 42).

Chapter 5, notebooks/05_zero.ipynb; the widget (widgets/ch05_zero.py) and the benchmark
(bench/zero.py) call these. Zhao et al. 2023 (PyTorch FSDP, "Sharding Strategies"): with parameters, gradients
and optimizer state sharded, a rank keeps 1/N of the model states — ZeRO-3's (4 + 4 + 8)Ψ/N
in fp32 (Rajbhandari et al. 2020, §5, Figure 1) — plus, for a moment, the units it has
gathered: the current one and the prefetched one, never the model (prefetching). Per step it sends
two all-gathers and one reduce-scatter of Ψ: 3Ψ·(N−1)/N elements (ZeRO §7); in bf16 the two
gathers move 2-byte elements and the reduce-scatter stays fp32: (2 + 2 + 4)Ψ·(N−1)/N bytes.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time

import torch
import torch.distributed as dist

from minitrain.zero.accounting import optimizer_state_tensors, storage_bytes

_BYTES = {None: 4, torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def fsdp_formula(num_params: int, world_size: int, compute_dtype=None) -> dict:
    """Bytes per rank (params, grads, optimizer, total) and bytes sent per step ("sent")
    for Ψ = ``num_params`` (padded) elements sharded over N = ``world_size`` ranks with AdamW.

    fp32: the ZeRO-3 formula, 4Ψ/N + 4Ψ/N + 8Ψ/N, sent 3·4Ψ·(N−1)/N. With a 2-byte
    ``compute_dtype`` the shard is 2Ψ/N and an fp32 master (4Ψ/N) joins the optimizer state;
    gradients stay fp32 (4Ψ/N); sent (2 + 2 + 4)Ψ·(N−1)/N."""
    if compute_dtype not in _BYTES:
        raise ValueError(f"compute_dtype must be None, float32, bfloat16 or float16, got {compute_dtype!r}")
    c, n = _BYTES[compute_dtype], world_size
    out = {
        "params": c * num_params / n,
        "grads": 4 * num_params / n,
        "optimizer": (8 + (4 if c != 4 else 0)) * num_params / n,
    }
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    out["sent"] = (2 * c + 4) * num_params * (n - 1) / n
    return out


def model_state_bytes(fsdp, optimizer) -> dict:
    """Bytes this rank keeps between steps, accounted from its tensors (not from formulas):
    params (the shards, and replicated units), grads (the shards' ``.grad``), optimizer (its
    per-element state, plus the fp32 masters when they are separate from the shards)."""
    units = fsdp.live_units()
    separate = fsdp.compute_dtype is not None
    gathered = [p for u in units for p in u.params]  # 0 bytes between steps (freed)
    state = optimizer_state_tensors(optimizer) + ([u.master for u in units] if separate else [])
    out = {
        "params": storage_bytes([u.shard for u in units] + gathered),
        "grads": storage_bytes([u.master.grad for u in units]),
        "optimizer": storage_bytes(state),
    }
    out["total"] = sum(out.values())
    return out


def predicted_peak_gathered_bytes(fsdp) -> int:
    """The most gathered bytes held at once: the root unit (embeddings, head: gathered for the
    whole forward and most of backward, as their layers bracket the blocks) plus the unit
    computing and the one prefetched — the largest pair of neighbouring blocks."""
    size = [u.padded * u.full.element_size() if u is not None else 0 for u in fsdp.units]
    blocks, root = size[:-1], size[-1]
    pairs = [a + b for a, b in zip(blocks, blocks[1:])] or blocks or [0]
    return root + max(pairs)


def one_process_reference(model, batches, compute_dtype=None, lr=1e-3, world=1):
    """What FSDP on ``world`` ranks should give, in one process: AdamW on fp32 weights; with
    ``compute_dtype`` each rank's share of each batch run on a copy cast to it, the
    gradients cast to fp32 and averaged (the casts FSDP makes). Returns the parameters
    (name → tensor) after each batch."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    out = []
    for x, y, loss_fn in batches:
        opt.zero_grad()
        if compute_dtype is None:
            loss_fn(model(x), y).backward()
        else:
            grads = [torch.zeros_like(p) for p in model.parameters()]
            for xs, ys in zip(x.chunk(world), y.chunk(world)):
                low = copy.deepcopy(model).to(compute_dtype)
                loss_fn(low(xs), ys).backward()
                for g, p in zip(grads, low.parameters()):
                    if p.grad is not None:
                        g += p.grad.float() / world
            for p, g in zip(model.parameters(), grads):
                p.grad = g
        opt.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def gpt_step_report(fsdp, optimizer, x, y) -> dict:
    """Run one training step of ``fsdp`` (a GPT) on this rank's ``(x, y)`` and return the
    numbers the notebook sets beside their formulas: model-state bytes, peak gathered bytes,
    bytes sent (counted by minitrain.zero), each with its prediction."""
    from minitrain import zero
    from minitrain.model import lm_loss

    zero.reset_bytes_sent()
    fsdp.reset_peak_gathered_bytes()
    optimizer.zero_grad()
    lm_loss(fsdp(x), y).backward()
    fsdp.finish_gradient_synchronization()
    optimizer.step()
    psi, world = fsdp.padded_numel(), dist.get_world_size(fsdp.group)
    return {
        "padded_numel": psi,
        "bytes": model_state_bytes(fsdp, optimizer),
        "formula": fsdp_formula(psi, world, fsdp.compute_dtype),
        "peak_gathered": fsdp.peak_gathered_bytes,
        "predicted_peak": predicted_peak_gathered_bytes(fsdp),
        "model_bytes": psi * _BYTES[fsdp.compute_dtype],
        "sent": zero.bytes_sent(),
    }


# ------------------------------------------------------------ prefetch on a modeled link (issue 42)
def measured(cls, expose: bool = False):
    """``cls`` (``ZeroDataParallel`` at stage 3, or ``FullyShardedDataParallel``) appending to
    ``self.gather_waits`` the seconds it waited for each unit whose gather had not finished
    (what prefetching did *not* hide). ``expose``: prefetch's overlap taken away (neither class
    has a switch: prefetch *is* their schedule) — before a unit computes it waits for every
    gather in flight, counted too. Collectives, their order and the results are unchanged."""

    class Measured(cls):
        def _wait_gather(self, u):
            start = time.perf_counter()
            super()._wait_gather(u)
            self.__dict__.setdefault("gather_waits", []).append(time.perf_counter() - start)

        def _expose(self) -> None:
            if expose:
                start = time.perf_counter()
                for u in self.live_units():
                    if u.state == "gathering":
                        u.work[0].wait()  # (waited again, harmlessly, when the unit is needed)
                self.__dict__.setdefault("gather_waits", []).append(time.perf_counter() - start)

        def _pre_forward(self, index):
            out = super()._pre_forward(index)
            self._expose()
            return out

        def _pre_backward(self, index):  # (the head's backward: _backward_begins)
            out = super()._pre_backward(index)
            self._expose()
            return out

        def _backward_begins(self, grad):
            out = super()._backward_begins(grad)
            self._expose()
            return out

    Measured.__name__ = Measured.__qualname__ = f"{'Exposed' if expose else 'Measured'}{cls.__name__}"
    return Measured


def unit_bytes(sharded) -> dict:
    """Bytes one step's collectives move per unit: "blocks" (each block's gather, in its
    compute dtype), "root"; "reduce" and "root_reduce" (fp32 reduce-scatters)."""
    blocks = [u for u in sharded.units[:-1] if u is not None]
    return {"blocks": [u.padded * u.full.element_size() for u in blocks],
            "root": sharded.root.padded * sharded.root.full.element_size(),
            "reduce": [u.padded * 4 for u in blocks], "root_reduce": sharded.root.padded * 4}


def predicted_step(compute: float, forward: float, backward: float, sizes: dict, world: int,
                   link, prefetch: bool = True) -> dict:
    """Step time of stage 3 / FSDP on ``link``: ``compute`` (the step without a link) plus the
    exposed communication, each collective its ring time (N−1)(α + n/(Nβ)) (link_costs).
    Always exposed: the root's two gathers (waited before forward and before backward), the
    last two reduce-scatters (block 0's and the root's: nothing computes after them). Without
    prefetch every block's two gathers add in full; with it a block's gather travels while
    its neighbour computes (``forward`` / ``backward``: one block's compute), exposing only
    what exceeds it — except the first of each pass (forward's block 0, backward's last
    block), which has only the embedding's or the head's small compute to hide behind."""
    from minitrain.runtime.link_costs import all_gather_time, reduce_scatter_time

    gathers = [all_gather_time(n, world, link) for n in sizes["blocks"]]
    tail = (reduce_scatter_time(sizes["reduce"][0], world, link)
            + reduce_scatter_time(sizes["root_reduce"], world, link))
    waits = 2 * all_gather_time(sizes["root"], world, link)
    if prefetch:
        waits += gathers[0] + gathers[-1]
        waits += sum(max(0.0, g - forward) for g in gathers[1:])
        waits += sum(max(0.0, g - backward) for g in gathers[:-1])
    else:
        waits += 2 * sum(gathers)
    return {"compute": compute, "waits": waits, "exposed": waits + tail,
            "step": compute + waits + tail, "gather": max(gathers), "gathers": 2 * sum(gathers)}


def _prefetch_rank(kind, config, batch, steps, ratio):
    """On each rank: the same step with prefetch and without (``measured(..., expose=True)``), on a link
    sized so one block's gather takes ``ratio`` × one block's forward, taking turns with
    the step without a link (the compute); per variant its step times."""
    from minitrain import zero
    from minitrain.fsdp import FullyShardedDataParallel
    from minitrain.model import GPT, GPTConfig, lm_loss
    from minitrain.runtime import get_device, trace
    from minitrain.runtime.link import Link, use_link

    rank, world, device = dist.get_rank(), dist.get_world_size(), get_device()

    def build(expose):
        torch.manual_seed(0)
        with torch.device(device):  # the model where this rank computes
            model = GPT(GPTConfig(**config))
        if kind == "fsdp":
            m = measured(FullyShardedDataParallel, expose)(model)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
            return m, opt.step, opt.zero_grad
        z = measured(zero.ZeroDataParallel, expose)(model, torch.optim.AdamW, 3, lr=1e-3)
        return z, z.step, z.zero_grad

    runs = {"prefetch": build(False), "exposed": build(True)}
    g = torch.Generator(device="cpu").manual_seed(1 + rank)  # CPU numbers, moved
    x, y = (torch.randint(0, config["vocab_size"], (batch // world, config["seq_len"]),
                          generator=g, device="cpu").to(device) for _ in range(2))

    def step(name):
        model, opt_step, zero_grad = runs[name]
        zero_grad()
        lm_loss(model(x), y).backward()
        opt_step()

    spans = {"forward": [], "backward": []}
    for i in range(5):  # two warm-up steps, then one block's compute without a link
        for name in ("exposed", "prefetch"):
            trace.reset()
            step(name)
        for e in trace.events() if i >= 2 else []:  # (prefetch's: its spans hold no waits)
            words = e.name.split(" ")
            if words[0] in spans and words[1] == "block":
                spans[words[0]].append(e.end - e.start)
    c = torch.tensor([statistics.median(spans["forward"]), statistics.median(spans["backward"])],
                     dtype=torch.float64, device=device)
    dist.all_reduce(c, op=dist.ReduceOp.MAX)  # every rank sizes the same link
    sizes = unit_bytes(runs["prefetch"][0])
    # one block's gather = ratio × its forward: a tenth latency, the rest bandwidth
    target = ratio * c[0].item() / (world - 1)
    link = Link(target / 10, max(sizes["blocks"]) / (world * 0.9 * target), "gather ≈ forward",
                f"sized so one block's all-gather takes {ratio:g}× one block's forward here")
    times = {"compute": [], "prefetch": [], "exposed": []}
    waited = {"prefetch": [], "exposed": []}
    for _ in range(steps):
        for name in times:
            dist.barrier()  # (outside the link: not part of the step)
            model = "prefetch" if name == "compute" else name
            runs[model][0].__dict__["gather_waits"] = []
            start = time.perf_counter()
            with use_link(link) if name != "compute" else contextlib.nullcontext():
                step(model)
            times[name].append(time.perf_counter() - start)
            if name in waited:
                waited[name].append(sum(runs[name][0].gather_waits))
    return {"times": times, "waited": waited, "forward": c[0].item(),
            "backward": c[1].item(), "link": link, "sizes": sizes}


def measure_prefetch(kind: str = "zero3", config=None, batch: int = 16, steps: int = 5,
                     ratio: float = 0.8, world: int = 2) -> dict:
    """Stage 3 (``kind="zero3"``, ``ZeroDataParallel``) or FSDP (``"fsdp"``) on ``world``
    ranks: one step with prefetch and one without, on a modeled link sized so one block's
    gather takes ``ratio`` × one block's forward, and without a link (the compute), taking
    turns. Returns {"step_time": {variant: median of the slowest rank's}, "spread", "waited"
    (s per step blocked on gathers), "predicted": {"prefetch", "exposed"} (``predicted_step``),
    "link", "forward", "backward" (one block's compute, s), "sizes" (``unit_bytes``)}."""
    from minitrain.runtime import launch, summarize_step_times

    if kind not in ("zero3", "fsdp"):
        raise ValueError(f"kind must be 'zero3' or 'fsdp', got {kind!r}")
    config = config or dict(vocab_size=64, seq_len=32, n_layer=4, n_head=4, d_model=128,
                            bias=False)
    res = launch(_prefetch_rank, world, kind, config, batch, steps, ratio, timeout=600)
    # a collective also waits for the last rank to call it: on a busy machine ranks drift
    # apart by milliseconds. The least-waiting rank's wait is the link's (the others' adds
    # that drift), so per step the least over ranks, then the median over steps.
    waited = {name: statistics.median(map(min, zip(*(r["waited"][name] for r in res))))
              for name in res[0]["waited"]}
    out = {**summarize_step_times([r["times"] for r in res]), "waited": waited,
           **{k: res[0][k] for k in ("link", "forward", "backward", "sizes")}}
    t = out["step_time"]
    out["predicted"] = {
        name: predicted_step(t["compute"], out["forward"], out["backward"], out["sizes"],
                             world, out["link"], prefetch=name == "prefetch")
        for name in ("prefetch", "exposed")}
    return out
