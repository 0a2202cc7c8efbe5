"""Unit tests of minitrain.step: gradient accumulation, FLOPs, MFU."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from minitrain.model import GPT, GPTConfig, gpt_num_params
from minitrain.step import (
    accumulate_gradients,
    flops_per_token,
    gradient_accumulation_steps,
    matmul_params,
    mfu,
    split_micro_batches,
    train_step,
)


def _big_batch_grads(model, x, y):
    model.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("micro", [1, 2, 3, 6])
def test_accumulated_gradients_equal_one_big_batch(micro):
    torch.manual_seed(0)
    model = GPT(GPTConfig()).double()
    x, y = torch.randint(0, 64, (6, 32)), torch.randint(0, 64, (6, 32))
    ref_loss, ref = _big_batch_grads(model, x, y)
    model.zero_grad(set_to_none=True)
    loss = accumulate_gradients(model, split_micro_batches(x, y, micro))
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], msg=n)


def test_unequal_micro_batches_are_weighted_by_tokens():
    torch.manual_seed(0)
    model = GPT(GPTConfig()).double()
    x, y = torch.randint(0, 64, (5, 32)), torch.randint(0, 64, (5, 32))
    _, ref = _big_batch_grads(model, x, y)
    model.zero_grad(set_to_none=True)
    accumulate_gradients(model, split_micro_batches(x, y, 2))  # 2 + 2 + 1 rows
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], msg=n)


def test_train_step_equals_a_manual_step():
    torch.manual_seed(0)
    a = GPT(GPTConfig()).double()
    b = GPT(GPTConfig()).double()
    b.load_state_dict(a.state_dict())
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    x, y = torch.randint(0, 64, (4, 32)), torch.randint(0, 64, (4, 32))
    stats = train_step(a, opt_a, x, y, micro_batch_size=2)
    ref_loss, _ = _big_batch_grads(b, x, y)
    opt_b.step()
    assert stats.loss == pytest.approx(ref_loss, rel=1e-12)
    assert stats.tokens == 4 * 32 and stats.tokens_per_second > 0
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb)


def test_gradient_accumulation_steps():
    assert gradient_accumulation_steps(64, 4, 2) == 8
    with pytest.raises(ValueError, match="global_batch=10"):
        gradient_accumulation_steps(10, 4, 1)


@pytest.mark.parametrize(
    "config,b",
    [
        (GPTConfig(), 4),
        (
            GPTConfig(
                vocab_size=50,
                seq_len=16,
                n_layer=3,
                n_head=2,
                d_model=32,
                d_ff=80,
                tie_weights=True,
            ),
            3,
        ),
    ],
)
def test_flops_per_token_matches_flop_counter(config, b):
    model = GPT(config)
    x = torch.randint(0, config.vocab_size, (b, config.seq_len))
    with FlopCounterMode(display=False) as counter:
        model.loss(x, x).backward()
    assert counter.get_total_flops() == flops_per_token(config) * b * config.seq_len


def test_matmul_params_leave_out_embeddings_biases_norms():
    c = GPTConfig()
    h, v, s, L = c.d_model, c.vocab_size, c.seq_len, c.n_layer
    assert gpt_num_params(c) - matmul_params(c) == v * h + s * h + L * 13 * h + 2 * h


def test_mfu():
    assert mfu(1000.0, 6e6, 1e10) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="peak_flops"):
        mfu(1.0, 1.0, 0.0)
