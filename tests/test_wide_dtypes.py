"""Accumulation dtypes (issue 26, items 3 and 6): low precision goes up to fp32, fp64 stays fp64.

The library accumulates in ``torch.promote_types(dtype, torch.float32)``. Upcasting with
``.float()`` instead gives a float64 input float32 accuracy (1e-7 instead of 1e-15) without
an error; sending a bf16 loss into an fp32 buffer reads 2e-41. Every check here is in float64
against an independent reference — torch's ``F.cross_entropy`` on the gathered logits,
``scaled_dot_product_attention`` on the whole sequence, the dense GPT in one process,
``torch.nn.utils.clip_grad_norm_`` — within 1e-9 (measured: 1e-15 after the fix, 1e-7 to
1e-8 before it, so the bound separates the two by two decades either way). The pipeline's
loss is compared across stages exactly, for bf16, fp16 and fp64 models.
"""

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from toy_models import Toy, mse, toy_batch  # tests/ is on sys.path under pytest

from minitrain.runtime import launch

TOL = 1e-9
F64 = torch.float64


def _sdpa(q, k, v, do, causal):
    """Output and gradients of torch's attention in float64: the oracle."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    gqa = q.dim() == 4 and q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


def _max_error(got, want):
    return max((a.detach() - b.detach()).abs().max().item() for a, b in zip(got, want))


# ------------------------------------------------------------------------- pipeline loss
def _pipeline_losses(dtypes):
    from minitrain.model import GPT, GPTConfig
    from minitrain.pipeline import PipelineStage

    out = {}
    for dtype in dtypes:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=16, seq_len=8, n_layer=2, n_head=2, d_model=8)).to(dtype)
        ref = copy.deepcopy(model)
        g = torch.Generator().manual_seed(1)
        x, y = (torch.randint(0, 16, (8, 8), generator=g) for _ in range(2))
        loss = PipelineStage(model).train_step(x, y, "1f1b", 4)
        with torch.no_grad():  # one process: each micro-batch's loss, and the whole batch's
            micro = [ref.loss(xm, ym).item() for xm, ym in zip(x.chunk(4), y.chunk(4))]
            whole = ref.loss(x, y).item()
        out[str(dtype)] = (loss.dtype, loss.item(), micro, whole)
    return out


def test_pipeline_returns_the_same_loss_on_every_stage_in_any_dtype():
    dtypes = [torch.bfloat16, torch.float16, F64]
    stages = launch(_pipeline_losses, 2, dtypes, timeout=180)
    for dtype in dtypes:
        (dtype0, loss0, _, _), (dtype1, loss1, micro, whole) = (r[str(dtype)] for r in stages)
        want_dtype = torch.promote_types(dtype, torch.float32)
        assert dtype0 == dtype1 == want_dtype, f"{dtype} model: the loss is {dtype0} / {dtype1}"
        assert loss0 == loss1, f"{dtype} model: stage 0 reports {loss0}, the last stage {loss1}"
        # the mean of the micro-batch losses, reduced in fp32 or wider (exact here: four bf16
        # or fp16 values sum exactly in fp32), not rounded back to the model's dtype
        mean = math.fsum(micro) / len(micro)
        assert abs(loss1 - mean) <= 1e-12 * abs(mean), f"{dtype}: {loss1} vs the mean {mean}"
        rel = 1e-12 if dtype == F64 else 2e-2  # the whole batch at once sums in another order
        assert abs(loss1 - whole) <= rel * abs(whole), f"{dtype}: {loss1} vs one process {whole}"


# ------------------------------------------------------------------------- tensor parallel
def _tensor_parallel_f64():
    from minitrain.model import GPT, GPTConfig
    from minitrain.tensor_parallel import apply_tensor_parallel, vocab_parallel_cross_entropy

    rank, world = dist.get_rank(), dist.get_world_size()
    errors = {}
    for scale in (1.0, 1e4):
        g = torch.Generator().manual_seed(3)
        full = (torch.randn(5, 7, 48, generator=g, dtype=F64) * scale).requires_grad_()
        targets = torch.randint(0, 48, (5, 7), generator=g)
        want = F.cross_entropy(full.reshape(-1, 48), targets.reshape(-1))
        want.backward()
        shard = full.detach().chunk(world, -1)[rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(shard, targets)
        loss.backward()
        errors[f"cross-entropy x{scale:g}"] = (
            loss.dtype, _max_error([loss / scale, shard.grad], [want / scale, full.grad.chunk(world, -1)[rank]]))
    for sp in (False, True):
        torch.manual_seed(0)
        dense = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32)).to(F64)
        tp = apply_tensor_parallel(copy.deepcopy(dense), sequence_parallel=sp)
        g = torch.Generator().manual_seed(1)
        x, y = (torch.randint(0, 64, (3, 16), generator=g) for _ in range(2))
        loss_d, loss_t = dense.loss(x, y), tp.loss(x, y)
        loss_d.backward()
        loss_t.backward()
        dense_grads = {n: p.grad for n, p in dense.named_parameters()}
        got, want = [loss_t], [loss_d]
        for name, p in tp.named_parameters():  # each TP shard against its slice of the dense grad
            full_grad = dense_grads[name]
            split = [d for d in range(p.dim()) if p.shape[d] != full_grad.shape[d]]
            got.append(p.grad)
            want.append(full_grad.chunk(world, split[0])[rank] if split else full_grad)
        errors["GPT" + (" + SP" if sp else "")] = (loss_t.dtype, _max_error(got, want))
    return errors


def test_tensor_parallel_float64_equals_dense():
    for rank, errors in enumerate(launch(_tensor_parallel_f64, 2, timeout=180)):
        for case, (dtype, error) in errors.items():
            assert dtype == F64, f"rank {rank}, {case}: the loss came back {dtype}"
            assert error <= TOL, f"rank {rank}, {case}: {error:.1e} from the fp64 dense value"


# ------------------------------------------------------------------------- flash attention
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shapes", [((2, 3, 37, 16), (2, 3, 37, 16)), ((2, 4, 33, 8), (2, 2, 33, 8)),
                                    ((1, 2, 20, 8), (1, 2, 45, 8))], ids=["mha", "gqa", "nk>nq"])
def test_flash_attention_float64_equals_sdpa(shapes, causal):
    from minitrain.flash_attention import FlashAttentionFunction, flash_attention_forward

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g, dtype=F64) for s in (shapes[0], shapes[1], shapes[1]))
    do = torch.randn(shapes[0], generator=g, dtype=F64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = FlashAttentionFunction.apply(*leaves, causal, 12, 11)  # tiles that do not divide N
    got = (out, *torch.autograd.grad(out, leaves, do))
    assert all(t.dtype == F64 for t in got)
    assert _max_error(got, _sdpa(q, k, v, do, causal)) <= TOL
    _, lse = flash_attention_forward(q, k, v, causal)
    assert lse.dtype == F64


def test_flash_attention_bf16_keeps_fp32_accumulators():
    from minitrain.flash_attention import flash_attention_forward

    q = torch.randn(1, 2, 9, 8, dtype=torch.bfloat16)
    out, lse = flash_attention_forward(q, q, q)
    assert (out.dtype, lse.dtype) == (torch.bfloat16, torch.float32)


def test_triton_kernels_refuse_float64_instead_of_rounding_it():
    pytest.importorskip("triton")
    from minitrain.flash_attention import FlashAttentionTritonFunction

    q = torch.randn(1, 1, 4, 16, dtype=F64)
    with pytest.raises(TypeError, match="float64.*FlashAttentionFunction"):
        FlashAttentionTritonFunction.apply(q, q, q, False)


# ------------------------------------------------------------------------- context parallel
def _ring_f64():
    from minitrain.context_parallel import ContextParallelGPT, ring_attention, shard_sequence
    from minitrain.model import GPT, GPTConfig

    errors = {}
    for layout in ("contiguous", "zigzag"):
        for causal in (False, True):
            g = torch.Generator().manual_seed(7)
            q, k, v, do = (torch.randn(2, 2, 24, 8, generator=g, dtype=F64) for _ in range(4))
            want = [shard_sequence(t, layout=layout) for t in _sdpa(q, k, v, do, causal)]
            local = [shard_sequence(t, layout=layout).requires_grad_() for t in (q, k, v)]
            out = ring_attention(*local, causal=causal, layout=layout)
            got = (out, *torch.autograd.grad(out, local, shard_sequence(do, layout=layout)))
            errors[f"ring {layout} causal={causal}"] = _max_error(got, want)
    torch.manual_seed(0)
    dense = GPT(GPTConfig(vocab_size=64, seq_len=24, n_layer=2, n_head=2, d_model=16)).to(F64)
    cp = ContextParallelGPT(copy.deepcopy(dense), layout="zigzag")
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 64, (2, 24), generator=g) for _ in range(2))
    want = dense.loss(x, y)
    want.backward()
    local = cp.loss(cp.shard(x), cp.shard(y))
    local.backward()
    cp.finish_gradient_synchronization()
    grads = [(p.grad, q.grad) for p, q in zip(cp.module.parameters(), dense.parameters())]
    errors["GPT loss"] = abs(cp.average_loss(local) - want.item())
    errors["GPT grads"] = _max_error(*zip(*grads))
    # the group's mean loss of bf16 losses 1 and 1 + 2^-7: a bf16 sum rounds 2 + 2^-7 to 2
    bf16 = torch.tensor(1.0 + dist.get_rank() * 2.0 ** -7, dtype=torch.bfloat16)
    errors["bf16 average_loss"] = abs(cp.average_loss(bf16) - (1.0 + 2.0 ** -8))
    return errors


def test_ring_attention_and_context_parallel_gpt_float64_equal_one_process():
    for rank, errors in enumerate(launch(_ring_f64, 2, timeout=180)):
        for case, error in errors.items():
            assert error <= TOL, f"rank {rank}, {case}: {error:.1e} from one fp64 process"


# ------------------------------------------------------------------------- MoE router, FSDP clipping
def test_moe_router_keeps_float64():
    from minitrain.moe import MoELayer

    torch.manual_seed(0)
    layer = MoELayer(6, 10, 4, top_k=2, aux_loss_weight=0).to(F64)
    x = torch.randn(14, 6, dtype=F64)
    layer(x)
    probs = layer.last_routing.probs
    want = torch.softmax(x @ layer.router.gate.weight.detach().t(), dim=-1)
    assert probs.dtype == F64 and (probs.detach() - want).abs().max().item() <= 1e-14


def _fsdp_clip_f64():
    from minitrain.fsdp import FullyShardedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    fsdp = FullyShardedDataParallel(Toy().to(F64))
    x, y = toy_batch(0, rank, world)
    mse(fsdp(x.to(F64)), y.to(F64)).backward()
    fsdp.finish_gradient_synchronization()
    norm = fsdp.clip_grad_norm_(0.05)
    return norm.dtype, norm.item()


def test_fsdp_clip_grad_norm_float64_equals_torch():
    torch.manual_seed(0)
    model = Toy().to(F64)
    x, y = toy_batch(0)
    mse(model(x.to(F64)), y.to(F64)).backward()
    want = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item()
    for dtype, norm in launch(_fsdp_clip_f64, 2, timeout=120):
        assert dtype == F64 and abs(norm - want) <= TOL * want, (dtype, norm, want)
