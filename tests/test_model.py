"""Unit tests of minitrain.model: parameter count, causality, attention against torch's SDPA."""

import pytest
import torch
import torch.nn.functional as F

from minitrain.model import (
    GPT,
    Block,
    GPTConfig,
    dropout,
    gpt_num_params,
    lm_loss,
    naive_attention,
    set_attention_fn,
)

CONFIGS = [
    GPTConfig(),
    GPTConfig(vocab_size=50, seq_len=16, n_layer=3, n_head=2, d_model=32, d_ff=80),
    GPTConfig(vocab_size=17, seq_len=9, n_layer=1, n_head=3, d_model=12, bias=False),
    GPTConfig(vocab_size=100, seq_len=8, n_layer=2, n_head=4, d_model=16, tie_weights=True),
    # issue 40: experts (chapter 8) were not counted
    GPTConfig(vocab_size=20, seq_len=8, n_layer=2, n_head=2, d_model=8, bias=False,
              moe_experts=3),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_num_params_formula_matches_numel(config):
    model = GPT(config)
    assert gpt_num_params(config) == sum(p.numel() for p in model.parameters())


def test_structure_is_swappable():
    model = GPT(GPTConfig())
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 2
    block = model.blocks[0]
    assert isinstance(block, Block)
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        assert isinstance(getattr(block.attn, name), torch.nn.Linear)
    assert isinstance(block.mlp.fc_in, torch.nn.Linear)
    assert block.attn.attention_fn is naive_attention


@pytest.mark.parametrize("causal", [True, False])
def test_naive_attention_matches_sdpa(causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ours = naive_attention(q, k, v, causal=causal)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(ours, ref)
    g = torch.randn_like(ours)
    ours_grads = torch.autograd.grad(ours, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(ours_grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_causal_future_tokens_do_not_change_past_logits():
    torch.manual_seed(0)
    model = GPT(GPTConfig()).eval()
    idx = torch.randint(0, 64, (2, 32))
    changed = idx.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 64
    a, b = model(idx), model(changed)
    assert a.shape == (2, 32, 64)
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_attention_fn_swap_with_sdpa_gives_same_output():
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    idx = torch.randint(0, 64, (2, 32))
    before = model(idx)

    def sdpa(q, k, v, causal=True, dropout_p=0.0, training=False):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    set_attention_fn(model, sdpa)
    assert all(b.attn.attention_fn is sdpa for b in model.blocks)
    torch.testing.assert_close(model(idx), before, rtol=1e-5, atol=1e-6)


def test_attention_heads_follow_projection_width():
    # Tensor parallelism gives each rank whole heads: a rank keeping half of q/k/v's outputs
    # and half of out_proj's inputs computes half of the output sum.
    torch.manual_seed(0)
    config = GPTConfig(n_head=4, d_model=32)
    attn = Block(config).attn
    x = torch.randn(2, 5, 32)
    full = attn(x)
    total = 0
    for half in (slice(0, 16), slice(16, 32)):
        part = Block(config).attn
        for name in ("q_proj", "k_proj", "v_proj"):
            src, dst = getattr(attn, name), getattr(part, name)
            dst.weight = torch.nn.Parameter(src.weight[half].clone())
            dst.bias = torch.nn.Parameter(src.bias[half].clone())
        part.out_proj.weight = torch.nn.Parameter(attn.out_proj.weight[:, half].clone())
        part.out_proj.bias = torch.nn.Parameter(attn.out_proj.bias.clone() / 2)
        total = total + part(x)
    torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-6)


def test_loss_matches_cross_entropy_and_starts_near_uniform():
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    idx, tgt = torch.randint(0, 64, (4, 32)), torch.randint(0, 64, (4, 32))
    logits = model(idx)
    ref = F.cross_entropy(logits.transpose(1, 2), tgt)
    torch.testing.assert_close(model.loss(idx, tgt), ref)
    torch.testing.assert_close(lm_loss(logits, tgt), ref)
    assert abs(ref.item() - torch.log(torch.tensor(64.0)).item()) < 0.1


def test_tied_weights_share_one_tensor():
    model = GPT(GPTConfig(tie_weights=True))
    assert model.head.weight is model.tok_emb.weight


def test_dropout_scales_and_masks():
    torch.manual_seed(0)
    x = torch.ones(200_000)
    y = dropout(x, 0.25, training=True)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.75) < 0.01
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / 0.75))
    assert dropout(x, 0.25, training=False) is x
    assert dropout(x, 0.0, training=True) is x


def test_dropout_is_active_only_in_training():
    torch.manual_seed(0)
    model = GPT(GPTConfig(dropout=0.2))
    idx = torch.randint(0, 64, (2, 32))
    model.eval()
    torch.testing.assert_close(model(idx), model(idx))
    model.train()
    assert not torch.allclose(model(idx), model(idx))


@pytest.mark.parametrize(
    "kwargs,word",
    [
        ({"d_model": 30, "n_head": 4}, "divisible"),
        ({"n_layer": 0}, "n_layer"),
        ({"dropout": 1.0}, "dropout"),
        ({"vocab_size": 2.5}, "vocab_size"),
    ],
)
def test_bad_config_names_the_value(kwargs, word):
    with pytest.raises(ValueError, match=word):
        GPTConfig(**kwargs)


def test_too_long_sequence_is_rejected():
    model = GPT(GPTConfig(seq_len=8))
    with pytest.raises(ValueError, match="seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))
