"""Each technique's step, as numbers: what tests/test_device_canary.py compares with and
without the device canary (torch's default device ``meta``, factories that must name their
device: tests/device_canary/sitecustomize.py).

Every case builds its model on the CPU (``with torch.device("cpu")``: the one place a device
is named for a whole module tree, and the CPU generator, so a GPU run starts from the very
weights a CPU run does — issue 41) and moves it to ``get_device()``, makes its data on the CPU
with a CPU generator and moves it explicitly, runs one or two steps on ``get_device()`` and
returns a flat list of floats.
Run as a script, it prints the results of the cases named on the command line as JSON.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

from minitrain.model import GPT, GPTConfig, lm_loss
from minitrain.runtime import get_device, launch

CONFIG = dict(vocab_size=32, seq_len=16, n_layer=2, n_head=2, d_model=32)


def _cpu_gen(seed):
    return torch.Generator(device="cpu").manual_seed(seed)


def _tokens(batch, seed=1, vocab=32, seq=16):
    g = _cpu_gen(seed)
    x = torch.randint(0, vocab, (batch, seq), generator=g, device="cpu")
    y = torch.randint(0, vocab, (batch, seq), generator=g, device="cpu")
    return x.to(get_device()), y.to(get_device())


def _gpt(**kw):
    torch.manual_seed(0)
    with torch.device("cpu"):  # the CPU generator's weights, on every device
        model = GPT(GPTConfig(**{**CONFIG, **kw}))
    return model.to(get_device())


# where each case's state lives: tests/gpu/ checks it is all on the rank's GPU
PLACES: dict[str, set[str]] = {}


def _record(*objects):
    """The devices of every parameter, gradient, buffer and optimizer state tensor of the
    modules and optimizers given, under the calling case's name (for tests/gpu)."""
    case = sys._getframe(1).f_code.co_name
    found = PLACES.setdefault(case, set())
    for obj in objects:
        tensors = []
        if isinstance(obj, torch.nn.Module):
            tensors += [t for t in obj.parameters()] + [t for t in obj.buffers()]
            tensors += [p.grad for p in obj.parameters() if p.grad is not None]
        elif isinstance(obj, torch.optim.Optimizer):
            tensors += [v for st in obj.state.values() for v in st.values() if torch.is_tensor(v)]
        elif torch.is_tensor(obj):
            tensors.append(obj)
        # an optimizer's step count is a CPU scalar by torch's design (not capturable)
        found.update(str(t.device) for t in tensors if t.dim() > 0 or t.device.type != "cpu")


def _numbers(*values, params=()):
    out = [float(v.detach()) if torch.is_tensor(v) else float(v) for v in values]
    out += [float(p.detach().double().sum()) for p in params]
    return out


def _my_rows(x, y):
    r, w = dist.get_rank(), dist.get_world_size()
    n = x.shape[0] // w
    return x[r * n:(r + 1) * n], y[r * n:(r + 1) * n]


# ------------------------------------------------------------------------------ the cases
def ddp():
    from minitrain.ddp import DataParallel

    model = DataParallel(_gpt(), bucket_cap_mb=0.01)
    # SGD: tests/gpu compares this case's numbers on the GPU and the CPU, and AdamW's first steps
    # (lr·sign(g)) would turn the two devices' last-bit differences into lr-sized ones
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = _my_rows(*_tokens(4))
    losses = []
    for _ in range(2):
        loss = model.module.loss(x, y)
        loss.backward()
        model.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    _record(model, opt)
    return _numbers(*losses, params=model.parameters())


def _zero(stage, compute_dtype=None, scaler=False):
    from minitrain.precision import DynamicLossScaler
    from minitrain.zero import ZeroDataParallel

    kw = dict(compute_dtype=compute_dtype, bucket_cap_mb=0.01)
    if scaler:
        kw["loss_scaler"] = DynamicLossScaler(init_scale=2.0**20)
    z = ZeroDataParallel(_gpt(), torch.optim.AdamW, stage, lr=1e-2, **kw)
    x, y = _my_rows(*_tokens(4))
    losses = []
    for _ in range(2):
        loss = lm_loss(z(x), y)  # through the wrapper: stage 3 gathers in its forward
        (kw["loss_scaler"].scale(loss) if scaler else loss).backward()
        z.step()
        z.zero_grad()
        losses.append(loss.item())
    _record(z.module, z.optimizer, *z.full_state_dict().values())
    return _numbers(*losses, params=z.full_state_dict().values())


def zero1():
    return _zero(1)


def zero2():
    return _zero(2)


def zero3():
    return _zero(3)


def zero3_bf16():
    return _zero(3, torch.bfloat16, scaler=True)


def fsdp():
    from minitrain.fsdp import FullyShardedDataParallel

    f = FullyShardedDataParallel(_gpt())
    opt = torch.optim.AdamW(f.parameters(), lr=1e-2)
    x, y = _my_rows(*_tokens(4))
    losses = []
    for _ in range(2):
        loss = lm_loss(f(x), y)
        loss.backward()
        f.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    _record(f, opt)
    return _numbers(*losses, params=f.full_state_dict().values())


def tp_sp():
    from minitrain.tensor_parallel import apply_tensor_parallel

    model = apply_tensor_parallel(_gpt(dropout=0.1), sequence_parallel=True)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    x, y = _tokens(2)
    losses = []
    for _ in range(2):
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    _record(model, opt)
    return _numbers(*losses, params=model.parameters())


def pipeline():
    from minitrain.pipeline import PipelineStage

    stage = PipelineStage(_gpt())
    opt = torch.optim.SGD(stage.model.parameters(), lr=1.0)
    x, y = _tokens(4)
    losses = []
    for _ in range(2):
        losses.append(float(stage.train_step(x, y, "1f1b", 4)))
        opt.step()
        opt.zero_grad()
    _record(stage.model, opt)
    return _numbers(*losses, params=stage.model.parameters())


def moe():
    from minitrain.moe import ExpertParallelMoE, MoELayer

    torch.manual_seed(0)
    # the CPU generator's weights, on every device
    local = MoELayer(8, 16, 4, top_k=2, capacity_factor=1.5, device="cpu").to(get_device())
    ep = ExpertParallelMoE.from_local(local)
    g = _cpu_gen(10 + dist.get_rank())
    x = torch.randn(12, 8, generator=g, device="cpu").to(get_device()).requires_grad_()
    out = ep(x)
    (out.square().sum() + ep.aux_loss).backward()
    _record(ep, out)
    return _numbers(out.sum(), x.grad.sum(), params=[p.grad for p in ep.parameters()])


def ring():
    from minitrain.context_parallel import gather_sequence, ring_attention, shard_sequence

    g = _cpu_gen(3)
    q, k, v, do = (torch.randn(1, 2, 16, 8, generator=g, device="cpu").to(get_device())
                   for _ in range(4))
    shards = [shard_sequence(t, layout="zigzag") for t in (q, k, v, do)]
    ql, kl, vl = (s.clone().requires_grad_() for s in shards[:3])
    out = ring_attention(ql, kl, vl, causal=True, layout="zigzag")
    out.backward(shards[3])
    full = gather_sequence(out.detach(), layout="zigzag")
    _record(out, full, ql.grad, kl.grad, vl.grad)
    return _numbers(full.sum(), ql.grad.sum(), kl.grad.sum(), vl.grad.sum())


def flash():
    from minitrain.flash_attention import flash_attention

    g = _cpu_gen(4)
    q, k, v = (torch.randn(1, 2, 24, 8, generator=g, device="cpu").to(get_device())
               .requires_grad_() for _ in range(3))
    out = flash_attention(q, k, v, causal=True)
    out.square().sum().backward()
    _record(out, q.grad)
    return _numbers(out.sum(), q.grad.sum(), k.grad.sum(), v.grad.sum())


def flash_triton():
    from minitrain.flash_attention import FlashAttentionTritonFunction

    g = _cpu_gen(5)
    q, k, v = (torch.randn(1, 1, 16, 16, generator=g, device="cpu").to(get_device())
               .requires_grad_() for _ in range(3))
    out = FlashAttentionTritonFunction.apply(q, k, v, True)
    out.square().sum().backward()
    _record(out, q.grad)
    return _numbers(out.sum(), q.grad.sum(), k.grad.sum(), v.grad.sum())


def checkpointing():
    from minitrain.checkpointing import set_checkpointing

    model = set_checkpointing(_gpt(dropout=0.2), "full")
    x, y = _tokens(2)
    torch.manual_seed(7)
    loss = model.loss(x, y)
    loss.backward()
    _record(model, loss.reshape(1).expand(2))
    return _numbers(loss, params=[p.grad for p in model.parameters()])


def keyed_dropout():
    """Issue 40: dropout keyed by global coordinates — TP + SP under recomputation, and CP's
    attention over gathered keys and values — through the trainer."""
    from minitrain.parallel import ParallelGPT

    losses = []
    for layout in (dict(tp=2, sequence_parallel=True, checkpointing="full"), dict(cp=2)):
        job = ParallelGPT(GPTConfig(**CONFIG, dropout=0.1), layout, 4, 1e-2, seed=0)
        losses += [job.step(s) for s in range(2)]
        _record(job.model)
    return _numbers(*losses)


def mixed_precision():
    from minitrain.precision import DynamicLossScaler, MasterWeightOptimizer

    model = _gpt().to(torch.bfloat16)
    opt = MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-2)
    scaler = DynamicLossScaler(init_scale=2.0**8)
    x, y = _tokens(2)
    losses = []
    for _ in range(2):
        loss = model.loss(x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    _record(model, opt.optimizer if hasattr(opt, "optimizer") else model)
    return _numbers(*losses, scaler.get_scale(), params=model.parameters())


# name -> (function, ranks)
CASES = {
    "DataParallel": (ddp, 2),
    "ZeRO-1": (zero1, 2),
    "ZeRO-2": (zero2, 2),
    "ZeRO-3": (zero3, 2),
    "ZeRO-3 bf16 + loss scaler": (zero3_bf16, 2),
    "FSDP": (fsdp, 2),
    "TP + SP": (tp_sp, 2),
    "PipelineStage 1F1B": (pipeline, 2),
    "expert-parallel MoE": (moe, 2),
    "ring attention": (ring, 2),
    "keyed dropout (TP + SP, CP)": (keyed_dropout, 2),
    "FlashAttention": (flash, 1),
    "FlashAttention Triton": (flash_triton, 1),
    "activation checkpointing": (checkpointing, 1),
    "mixed-precision optimizer": (mixed_precision, 1),
}


def _each(names):
    """name -> {"numbers": ...} or {"error": ...}: one broken case does not hide the others."""
    results = {}
    for name in names:
        start = time.perf_counter()
        try:
            results[name] = {"numbers": CASES[name][0]()}
        except Exception as exc:  # reported by name in the test
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[-3000:]}
        results[name]["seconds"] = round(time.perf_counter() - start, 2)
    return results


def _in_turn(names):
    """The cases one after the other in a rank; a raise ends the launch at once (the parent
    stops the other rank, which would otherwise wait in a collective until the timeout)."""
    return {name: CASES[name][0]() for name in names}


def run_each(names):
    """Every named case: the one-process ones here, the two-rank ones in one launch (one
    start-up for all of them; if it fails, each in its own, so the error is the case's).
    name -> {"numbers": [per rank]} or {"error": text}."""
    single = [n for n in names if CASES[n][1] == 1]
    multi = [n for n in names if CASES[n][1] == 2]
    results = {n: {**r, "numbers": [r["numbers"]]} if "numbers" in r else r
               for n, r in _each(single).items()}
    groups = [multi]
    while groups:
        group = groups.pop(0)
        try:
            per_rank = launch(_in_turn, 2, group, timeout=120, print_output=False)
        except Exception as exc:
            if len(group) > 1:
                groups += [[name] for name in group]
                continue
            results[group[0]] = {"error": f"{type(exc).__name__}: {exc}"[-3000:]}
            continue
        for name in group:
            results[name] = {"numbers": [r[name] for r in per_rank]}
    return results


if __name__ == "__main__":
    print(json.dumps(run_each(sys.argv[1:] or list(CASES))))
