"""Issue 40, item 3: dropout is layout-free (docs/design.md, "Dropout, keyed").

Every mask is a function of (seed, step, layer, site, the element's global coordinates)
(``minitrain.dropout``), so with ``GPTConfig(dropout=0.1)`` every layout — dp, tp (± SP), pp
(GPipe and 1F1B, with and without recomputation), cp (attention over gathered keys), MoE —
follows one process's loss curve within 1e-5, where torch's generator gave each rank its own
masks (dp2: 4.1589 vs 4.1575 at step 0). Unit tests of the mask function first; then the
layouts, in one 2-rank and one 4-rank launch, against ``ParallelGPT`` on one process.
"""

import io
import math

import pytest
import torch
import torch.distributed as dist

from minitrain.dropout import DropoutKey, DropoutKeys, DropoutSite, keep_mask
from minitrain.memory import saved_activation_bytes
from minitrain.model import GPT, Block, GPTConfig, dropout
from minitrain.parallel import ParallelGPT, single_process_losses
from minitrain.runtime import launch

CFG = GPTConfig(vocab_size=32, seq_len=16, n_layer=4, n_head=4, d_model=32, dropout=0.1)
MOE = GPTConfig(vocab_size=32, seq_len=16, n_layer=2, n_head=4, d_model=32, dropout=0.1,
                moe_experts=4, moe_top_k=2)
MODELS = {"dense": CFG, "moe": MOE}
BATCH, SEED, STEPS = 8, 0, 3
LR = {"sgd": 0.5, "adamw": 1e-2}  # sgd at lr 0.5: a scale error in a gradient shows at once


def _agreement(a, b):
    return (a == b).float().mean().item()


# --------------------------------------------------------------------------- the mask function
def test_drop_rate_is_p_within_five_sigma():
    coords = (torch.arange(64), torch.arange(128), torch.arange(64))
    for p in (0.1, 0.5):
        keep = keep_mask(p, (SEED, 0, 0, 0), coords)
        assert keep.dtype == torch.bool and keep.shape == (64, 128, 64)
        sigma = math.sqrt(p * (1 - p) / keep.numel())
        assert abs((~keep).float().mean().item() - p) < 5 * sigma
    assert keep_mask(0.0, (SEED,), coords).all()


def test_a_slice_of_the_mask_is_the_mask_of_the_sliced_coordinates():
    """Layout-freedom in one line: whatever a rank holds (rows 3..6, a zigzag shard of the
    positions, heads 2..3), it draws one process's mask for it."""
    rows, heads, pos = torch.arange(8), torch.arange(4), torch.arange(16)
    whole = keep_mask(0.3, (1, 2, 3, 1), (rows, heads, pos, pos))
    zigzag = torch.cat([pos[:4], pos[12:]])
    part = keep_mask(0.3, (1, 2, 3, 1), (rows[3:6], heads[2:], zigzag, pos))
    assert torch.equal(part, whole[3:6, 2:][:, :, zigzag])
    assert torch.equal(whole, keep_mask(0.3, (1, 2, 3, 1), (rows, heads, pos, pos)))  # pure


def _site(name="mlp_output", step=0, layer=0, rows=None):
    key = DropoutKey(SEED, step, torch.arange(16) if rows is None else rows, torch.arange(32))
    return DropoutSite(key, layer, name)


def test_masks_are_independent_across_steps_layers_sites_and_rows():
    """p = 0.5: two independent masks agree on half the elements (± 5 sigma); the key's words
    all reach the hash (a step, a layer or a site left out would give the same mask twice)."""
    x = torch.ones(16, 32, 64)
    base = _site().keep(x, 0.5)
    sigma = math.sqrt(0.25 / x.numel())
    others = {"step": _site(step=1), "layer": _site(layer=1), "site": _site("attention_output"),
              "rows": _site(rows=torch.arange(16, 32))}
    for what, site in others.items():
        assert abs(_agreement(base, site.keep(x, 0.5)) - 0.5) < 5 * sigma, what
    # within one mask, row 0 and row 1 are independent too
    assert abs(_agreement(base[0], base[1]) - 0.5) < 5 * math.sqrt(0.25 / base[0].numel())


def test_a_stale_key_is_refused_naming_the_site():
    with pytest.raises(ValueError, match="mlp_output of layer 0.*own rows"):
        _site().keep(torch.ones(4, 32, 64), 0.1)  # a key of 16 rows for a batch of 4


def test_without_a_key_dropout_draws_from_torchs_generator():
    """Chapters 1–3 (and their committed notebook outputs): a plain GPT's dropout is
    ``torch.rand_like(x) >= p``, as before."""
    x = torch.randn(4, 8, 16)
    torch.manual_seed(3)
    want = x * (torch.rand_like(x) >= 0.25) * (1 / 0.75)
    torch.manual_seed(3)
    assert torch.equal(dropout(x, 0.25, True), want)
    model = GPT(CFG).train()
    assert model.dropout_keys.current is None
    idx = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(5)
    first = model(idx)
    torch.manual_seed(5)
    assert torch.equal(model(idx), first)


def test_a_keyed_gpt_ignores_the_generator_and_numbers_its_layers_globally():
    model = GPT(CFG).train()
    keys = model.dropout_keys
    assert [b.layer for b in model.blocks] == [b.attn.layer for b in model.blocks] == [0, 1, 2, 3]
    assert all(b.dropout_keys is keys and b.attn.dropout_keys is keys for b in model.blocks)
    idx = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(0))
    keys.current = keys.key(SEED, 0, torch.arange(2), torch.arange(16))
    torch.manual_seed(5)
    first = model(idx)
    torch.manual_seed(6)  # another generator state: the same masks
    assert torch.equal(model(idx), first)
    keys.current = keys.key(SEED, 1, torch.arange(2), torch.arange(16))
    assert not torch.equal(model(idx), first)  # another step: other masks


def test_the_keyed_mask_saved_for_backward_is_one_byte_per_element():
    """Chapter 1's memory lesson counts a 1-byte bool mask: keyed, the block saves exactly
    what it saves with torch's generator."""
    torch.manual_seed(0)
    keys = DropoutKeys()
    block = Block(CFG, layer=2, dropout_keys=keys).train()
    x = torch.randn(3, 16, 32, requires_grad=True)
    plain = saved_activation_bytes(block, x)
    keys.current = keys.key(SEED, 0, torch.arange(3), torch.arange(16))
    assert saved_activation_bytes(block, x) == plain


# --------------------------------------------------------------------------- every layout
# name -> (world size, model, layout); the optimizer is SGD unless the layout says AdamW
CASES = {
    "dp2": (2, "dense", dict(dp=2)),
    "tp2": (2, "dense", dict(tp=2)),
    "tp2+sp": (2, "dense", dict(tp=2, sequence_parallel=True)),
    "tp2+sp-full": (2, "dense", dict(tp=2, sequence_parallel=True, checkpointing="full")),
    "pp2-gpipe": (2, "dense", dict(pp=2, microbatches=2, schedule="gpipe")),
    "pp2-gpipe-full": (2, "dense", dict(pp=2, microbatches=2, schedule="gpipe",
                                        checkpointing="full")),
    "pp2-1f1b-full": (2, "dense", dict(pp=2, microbatches=4, checkpointing="full")),
    "cp2": (2, "dense", dict(cp=2)),
    "dp2-adamw": (2, "dense", dict(dp=2, microbatches=2, optimizer="adamw")),
    "moe-dp2-ep2": (2, "moe", dict(dp=2, ep=2)),
    "moe-tp2": (2, "moe", dict(tp=2)),
    "dp2xcp2": (4, "dense", dict(dp=2, cp=2)),
    "pp2xtp2+sp-1f1b-full": (4, "dense", dict(pp=2, tp=2, sequence_parallel=True,
                                              microbatches=2, checkpointing="full")),
}
RESUMED = "pp2-1f1b-full"  # 1F1B with recomputation, resumed after step 1


def _job(name):
    _, model, layout = CASES[name]
    layout = {"optimizer": "sgd", **layout}
    return ParallelGPT(MODELS[model], layout, BATCH, LR[layout["optimizer"]], SEED)


def _run_cases(names):
    """On every rank: each case's losses over STEPS steps; the resumed case's losses too."""
    out = {name: [job.step(s) for s in range(STEPS)] for name in names for job in [_job(name)]}
    if RESUMED in names:
        first = _job(RESUMED)
        got = [first.step(0)]
        buffer = io.BytesIO()
        torch.save(first.state(), buffer)
        buffer.seek(0)
        resumed = _job(RESUMED)
        resumed.load_state(torch.load(buffer, weights_only=True))
        out["resumed"] = got + [resumed.step(s) for s in range(1, STEPS)]
    return out


@pytest.fixture(scope="module")
def one_process():
    """The reference: ``ParallelGPT`` on one process (dp = tp = pp = cp = 1), per model and
    optimizer, and ``single_process_losses`` of the dense model."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        out = {}
        for model, opt in {(CASES[n][1], CASES[n][2].get("optimizer", "sgd")) for n in CASES}:
            job = ParallelGPT(MODELS[model], {"optimizer": opt}, BATCH, LR[opt], SEED)
            out[model, opt] = [job.step(s) for s in range(STEPS)]
    finally:
        dist.destroy_process_group()
    out["plain"] = single_process_losses(CFG, STEPS, BATCH, LR["sgd"], SEED, optimizer="sgd")
    return out


@pytest.fixture(scope="module")
def layouts():
    """Each rank's results: one 2-rank and one 4-rank launch run every case of their size."""
    results = {}
    for world in sorted({w for w, _, _ in CASES.values()}):
        names = [n for n, (w, _, _) in CASES.items() if w == world]
        results[world] = launch(_run_cases, world, names, timeout=600)
    return results


def test_the_reference_is_single_process_losses(one_process):
    want = one_process["dense", "sgd"]
    assert max(abs(a - b) for a, b in zip(one_process["plain"], want)) <= 1e-6


@pytest.mark.parametrize("name", list(CASES))
def test_dropout_losses_equal_one_process(one_process, layouts, name):
    world, model, layout = CASES[name]
    want = one_process[model, layout.get("optimizer", "sgd")]
    for rank, result in enumerate(layouts[world]):  # every rank logs the global mean
        gap = max(abs(a - b) for a, b in zip(result[name], want))
        assert gap <= 1e-5, f"{name}, rank {rank}: losses {result[name]} vs one process {want}"


def test_resume_with_dropout_is_bit_exact(layouts):
    for rank, result in enumerate(layouts[CASES[RESUMED][0]]):
        assert result["resumed"] == result[RESUMED], f"rank {rank}"
