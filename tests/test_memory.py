"""Unit tests of minitrain.memory: the bytes-per-parameter table, saved-tensor measurement,
the activation formula against measurement, and the memory timeline of a step."""

import pytest
import torch

from minitrain.memory import (
    block_activation_bytes,
    estimate_training_memory,
    memory_timeline,
    model_activation_bytes,
    saved_activation_bytes,
)
from minitrain.model import GPT, Block, GPTConfig

GB = 1e9
# The standard table (e.g. Rajbhandari et al. 2020, section 3.1: 2+2+12 bytes per parameter
# with fp32 master, moments; plus 4 for fp32 gradient accumulation): params -> GB
TABLE = {1e9: (16, 20), 7e9: (112, 140), 70e9: (1120, 1400), 405e9: (6480, 8100)}


@pytest.mark.parametrize("params", list(TABLE))
def test_estimate_reproduces_the_published_table(params):
    fp32, mixed = TABLE[params]
    assert estimate_training_memory(int(params), "fp32")["total"] == fp32 * GB
    assert estimate_training_memory(int(params), "mixed")["total"] == mixed * GB
    assert estimate_training_memory(params, "mixed") == estimate_training_memory(int(params), "mixed")


@pytest.mark.parametrize("precision", ["fp32", "mixed"])
def test_parts_sum_to_total(precision):
    est = estimate_training_memory(1000, precision)
    assert {"weights", "gradients", "master", "optimizer", "total"} <= set(est)
    assert sum(v for k, v in est.items() if k != "total") == est["total"]
    assert est["optimizer"] == 8000  # Adam's two fp32 moments


def test_estimate_rejects_bad_input():
    with pytest.raises(ValueError, match="'fp16'"):
        estimate_training_memory(10, "fp16")
    with pytest.raises(ValueError, match="-5"):
        estimate_training_memory(-5)
    with pytest.raises(ValueError, match="1.5"):
        estimate_training_memory(1.5)


def test_saved_bytes_of_simple_ops():
    x = torch.randn(10, 20, requires_grad=True)
    assert saved_activation_bytes(torch.exp, x) == 10 * 20 * 4  # exp saves its result
    # sin and cos both save x: one storage, counted once
    assert saved_activation_bytes(lambda t: t.sin() + t.cos(), x) == 10 * 20 * 4
    # a view saves its whole storage
    assert saved_activation_bytes(lambda t: t[:2].exp(), x) == 2 * 20 * 4 + 0
    assert saved_activation_bytes(lambda t: t[:, :2].sin(), x) == 10 * 20 * 4
    # nothing requires grad: nothing is saved
    assert saved_activation_bytes(torch.exp, x.detach()) == 0


def test_parameters_and_their_views_are_excluded():
    lin = torch.nn.Linear(20, 30)
    x = torch.randn(4, 20, requires_grad=True)
    # Linear saves its input and a transposed view of its weight: only the input counts
    assert saved_activation_bytes(lin, x) == 4 * 20 * 4
    assert saved_activation_bytes(lambda t: lin(t), x) == 4 * 20 * 4
    w = torch.randn(30, 20, requires_grad=True)  # a plain leaf tensor, not a Parameter
    assert saved_activation_bytes(lambda t: t @ w.t(), x) == (4 * 20 + 30 * 20) * 4
    assert saved_activation_bytes(lambda t: t @ w.t(), x, exclude=[w]) == 4 * 20 * 4


BLOCK_CASES = [  # (b, s, h, a, d_ff, dropout)
    (2, 16, 64, 4, None, 0.0),
    (3, 32, 48, 6, None, 0.0),
    (1, 8, 32, 2, 80, 0.0),
    (4, 24, 64, 8, None, 0.1),
    (2, 12, 40, 5, 100, 0.3),
]


@pytest.mark.parametrize("b,s,h,a,f,p", BLOCK_CASES)
def test_block_formula_matches_measurement(b, s, h, a, f, p):
    torch.manual_seed(0)
    block = Block(GPTConfig(seq_len=s, n_head=a, d_model=h, d_ff=f, dropout=p)).train()
    x = torch.randn(b, s, h, requires_grad=True)
    assert saved_activation_bytes(block, x) == block_activation_bytes(b, s, h, a, f, p)


def test_block_formula_is_korthikanti_in_fp32():
    # f = 4h, no dropout, 4-byte elements: sbh(64 + 4as/h) + 16sb
    b, s, h, a = 2, 128, 256, 8
    expected = s * b * h * (64 + 4 * a * s / h) + 16 * s * b
    assert block_activation_bytes(b, s, h, a) == expected


@pytest.mark.parametrize(
    "config,b",
    [
        (GPTConfig(), 4),
        (GPTConfig(vocab_size=50, seq_len=16, n_layer=3, n_head=2, d_model=32, dropout=0.1), 3),
        (GPTConfig(vocab_size=30, seq_len=8, n_layer=1, n_head=4, d_model=16, tie_weights=True), 2),
    ],
)
def test_model_formula_matches_measurement(config, b):
    torch.manual_seed(0)
    model = GPT(config).train()
    x = torch.randint(0, config.vocab_size, (b, config.seq_len))
    y = torch.randint(0, config.vocab_size, (b, config.seq_len))
    assert saved_activation_bytes(model.loss, x, y) == model_activation_bytes(config, b)


def test_timeline_of_two_steps():
    torch.manual_seed(0)
    config = GPTConfig()
    model = GPT(config)
    opt = torch.optim.Adam(model.parameters())
    batches = [(torch.randint(0, 64, (4, 32)), torch.randint(0, 64, (4, 32))) for _ in range(2)]
    points = memory_timeline(model, opt, lambda m, x, y: m.loss(x, y), batches)
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    by = {(p["step"], p["label"]): p for p in points}
    # forward: activations grow block by block to what the loss saves
    assert by[1, "start"]["activations"] == 0
    assert 0 < by[1, "block 0"]["activations"] < by[1, "block 1"]["activations"]
    assert by[1, "loss"]["activations"] == model_activation_bytes(config, 4)
    # backward frees them and fills the gradients
    assert by[1, "end of backward"]["activations"] == 0
    assert by[1, "end of backward"]["gradients"] == param_bytes
    # Adam's state appears at the first step: two moments + a 4-byte step count per tensor
    assert by[1, "end of backward"]["optimizer"] == 0
    assert by[1, "optimizer.step"]["optimizer"] == 2 * param_bytes + 4 * n_tensors
    assert by[2, "start"]["optimizer"] == 2 * param_bytes + 4 * n_tensors
    assert by[2, "zero_grad"]["gradients"] == 0
    assert all(p["parameters"] == param_bytes for p in points)
    backward = [p for p in points if p["phase"] == "backward" and p["step"] == 1]
    acts = [p["activations"] for p in backward]
    assert acts == sorted(acts, reverse=True)  # activations only shrink during backward
    # the timeline's hooks are removed afterwards
    assert saved_activation_bytes(model.loss, *batches[0]) == model_activation_bytes(config, 4)
