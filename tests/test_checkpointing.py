"""Tests of minitrain.checkpointing against plain autograd, torch.utils.checkpoint and formulas."""

import copy
import math

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import checkpoint_sequential as torch_checkpoint_sequential
from torch.utils.flop_counter import FlopCounterMode

from minitrain.checkpointing import (
    checkpoint,
    checkpoint_sequential,
    choose_segments,
    policy_extra_flops,
    policy_peak_bytes,
    policy_saved_bytes,
    run_in_order,
    segment_sizes,
    sequential_peak_bytes,
    set_checkpointing,
)
from minitrain.checkpointing.measure import chain_sweep, tiny_setup, track_step
from minitrain.memory import LiveSavedBytes, saved_activation_bytes
from minitrain.model import GPTConfig, dropout, naive_attention, set_attention_fn


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny ops: one thread is faster and steadier on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Mixer(nn.Module):
    """Two tensor inputs, a non-tensor argument, two outputs, dropout: every feature at once."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, y, scale, p=0.5):
        h = dropout(torch.tanh(self.a(x)) * scale + self.b(y), p, True)
        return h.relu(), (h * y).sum(-1)


def _grads(module, *tensors):
    return [t.grad for t in tensors] + [p.grad for p in module.parameters()]


def _run(use_checkpoint, y_requires_grad=True, preserve=True):
    torch.manual_seed(0)
    module = Mixer()
    x = torch.randn(4, 8, requires_grad=True)
    y = torch.randn(4, 8, requires_grad=y_requires_grad)
    torch.manual_seed(123)
    if use_checkpoint:
        out, s = checkpoint(module, x, y, 3.0, preserve_rng_state=preserve)
    else:
        out, s = module(x, y, 3.0)
    (out.square().sum() + s.sum()).backward()
    after = torch.rand(3)  # the RNG stream must continue as if nothing was recomputed
    return (out.detach(), s.detach(), after, *_grads(module, x, y))


@pytest.mark.parametrize("y_requires_grad", [True, False])
def test_checkpoint_gradients_equal_plain_autograd_with_dropout(y_requires_grad):
    plain, ckpt = _run(False, y_requires_grad), _run(True, y_requires_grad)
    for i, (a, b) in enumerate(zip(plain, ckpt)):
        if a is None:
            assert b is None, f"item {i}: plain autograd gives None, checkpoint a tensor"
        else:
            assert torch.equal(a, b), f"item {i} differs with checkpointing"


def test_without_rng_restore_dropout_masks_differ():
    plain, unrestored = _run(False), _run(True, preserve=False)
    assert torch.equal(plain[0], unrestored[0])  # forward is identical...
    assert not torch.equal(plain[3], unrestored[3])  # ...but backward used other masks


def test_checkpoint_saves_only_its_tensor_inputs():
    module = Mixer()
    x, y = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    saved = saved_activation_bytes(lambda: checkpoint(module, x, y, 2.0), exclude=[module])
    assert saved == x.nbytes + y.nbytes
    assert saved < saved_activation_bytes(lambda: module(x, y, 2.0), exclude=[module])


def test_unused_output_and_matches_torch_checkpoint():
    torch.manual_seed(0)
    module = Mixer()
    x = torch.randn(4, 8, requires_grad=True)
    y = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(5)
    mine = checkpoint(module, x, y, 1.5)[0].sum()
    mine.backward()
    ours = [t.grad.clone() for t in (x, y)]
    x.grad = y.grad = None
    torch.manual_seed(5)
    torch_checkpoint(module, x, y, 1.5, use_reentrant=True)[0].sum().backward()
    assert all(torch.equal(a, t.grad) for a, t in zip(ours, (x, y)))


def test_checkpoint_warns_without_grad_inputs_and_rejects_non_callable():
    with pytest.warns(UserWarning, match="no tensor argument requires grad"):
        checkpoint(torch.tanh, torch.randn(3))
    with pytest.raises(TypeError, match="callable"):
        checkpoint(3, torch.randn(3))


def test_checkpoint_recomputes_under_the_same_autocast():
    layer = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    grads = []
    for use in (False, True):
        x.grad = None
        layer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = checkpoint(layer, x) if use else layer(x)
        out.float().sum().backward()
        grads.append((x.grad.clone(), layer.weight.grad.clone()))
    assert out.dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(*grads))


ACCELERATOR = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None


@pytest.mark.skipif(ACCELERATOR is None, reason="needs an accelerator (cuda, xpu, mps...)")
def test_checkpoint_replays_the_device_rng():
    device = ACCELERATOR
    x = torch.randn(64, device=device, requires_grad=True)
    grads = []
    for use in (False, True):
        x.grad = None
        torch.manual_seed(3)
        fn = lambda t: dropout(t * 2, 0.5, True)
        (checkpoint(fn, x) if use else fn(x)).sum().backward()
        grads.append(x.grad.clone())
    assert torch.equal(*grads)


# ---------------------------------------------------------------------------- sequential
def test_segment_sizes():
    assert segment_sizes(10, 4) == [2, 2, 3, 3]
    assert segment_sizes(8, 8) == [1] * 8
    for bad in (0, 9, 2.0):
        with pytest.raises(ValueError, match=repr(bad)):
            segment_sizes(8, bad)


@pytest.mark.parametrize("segments", [1, 2, 3, 4, 6])
def test_checkpoint_sequential_gradients_and_bytes_match_torch(segments):
    torch.manual_seed(0)
    layers = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(12)))
    x = torch.randn(5, 16, requires_grad=True)
    checkpoint_sequential(layers, segments, x).square().sum().backward()
    ours = [p.grad.clone() for p in layers.parameters()] + [x.grad.clone()]
    layers.zero_grad()
    x.grad = None
    layers(x).square().sum().backward()
    plain = [p.grad for p in layers.parameters()] + [x.grad]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ours, plain))
    # 12 is divisible by these segment counts, so torch splits the same way
    mine = saved_activation_bytes(checkpoint_sequential, layers, segments, x)
    theirs = saved_activation_bytes(
        lambda: torch_checkpoint_sequential(layers, segments, x, use_reentrant=True),
        exclude=[layers],
    )
    assert mine == theirs


def test_chain_peak_is_the_formula_and_smallest_at_sqrt_L():
    rows = chain_sweep(num_layers=16, width=8, batch=4)
    c = 4 * 8 * 4
    for row in rows:  # (k - 1) c + ceil(L / k) c, written out independently
        assert row["peak"] == (row["segments"] - 1) * c + math.ceil(16 / row["segments"]) * c
    assert min(rows, key=lambda r: r["peak"])["segments"] == 4  # sqrt(16)


def test_sequential_peak_bytes_and_choose_segments():
    assert sequential_peak_bytes(64, 8, 10, 10) == 7 * 10 + 8 * 10
    assert choose_segments(64, 10, 10) == 8
    assert choose_segments(100, 10, 10) == 10
    assert choose_segments(16, 20, 1) == 16  # transformer-like: A >> c
    assert choose_segments(64, 10, 10, budget_bytes=330) == 2  # peaks 640, 330, 240
    assert choose_segments(64, 10, 10, budget_bytes=329) == 3
    with pytest.raises(ValueError, match="budget_bytes=5"):
        choose_segments(4, 10, 10, budget_bytes=5)


def test_choose_segments_is_the_smallest_k_of_least_peak():
    # ties, written out: L=6, A=c=1 peaks [6, 4, 4, 5, 5, 6]; L=3 peaks all 3;
    # L=6, A=3, c=1 peaks [18, 10, 8, 10, 10, 8]; L=4, A=2, c=1 peaks [8, 5, 6, 5]
    assert choose_segments(6, 1, 1) == 2
    assert choose_segments(3, 1, 1) == 1
    assert choose_segments(6, 3, 1) == 3
    assert choose_segments(4, 2, 1) == 2
    for L in range(1, 13):  # brute force over the formula, smallest k first
        for A in range(1, 5):
            for c in range(1, 5):
                peaks = [sequential_peak_bytes(L, k, A, c) for k in range(1, L + 1)]
                want = 1 + peaks.index(min(peaks))
                assert choose_segments(L, A, c) == want, (L, A, c, peaks)


def test_choose_segments_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="budget_bytes=149: the smallest predicted peak is 150"):
        choose_segments(64, 10, 10, budget_bytes=149)  # k=8: 7*10 + 8*10 = 150
    assert choose_segments(64, 10, 10, budget_bytes=150) == 8
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match=f"num_layers must be a positive int, got {bad}"):
            choose_segments(bad, 10, 10)


# ---------------------------------------------------------------------------- the GPT
POLICIES = [
    ("none", 1),
    ("full", 1),
    ("every_k", 2),
    ("every_k", 3),
    ("selective", 1),
    ("segments", 1),
    ("segments", 2),
    ("segments", 3),
    ("segments", 4),
]


@pytest.fixture(scope="module")
def gpt():
    return tiny_setup(n_layer=4, batch=3, dropout=0.1)


def _step(model, idx, targets):
    torch.manual_seed(7)
    model.zero_grad(set_to_none=True)
    loss = model.loss(idx, targets)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, torch.rand(2)


@pytest.mark.parametrize("policy,k", POLICIES)
def test_policy_gradients_bytes_and_flops(gpt, policy, k):
    model, idx, targets = gpt
    loss, grads, rng_after = _step(copy.deepcopy(model), idx, targets)
    ckpt = set_checkpointing(copy.deepcopy(model), policy, k)
    loss2, grads2, rng_after2 = _step(ckpt, idx, targets)
    assert torch.equal(loss, loss2) and torch.equal(rng_after, rng_after2)
    for name, g in grads.items():
        assert torch.equal(g, grads2[name]), f"{policy}({k}): gradient of {name} differs"
    torch.manual_seed(7)
    saved = saved_activation_bytes(ckpt.loss, idx, targets)
    assert saved == policy_saved_bytes(model.config, 3, policy, k)
    flops = []
    for m in (model, ckpt):
        with FlopCounterMode(display=False) as counter:
            _step(m, idx, targets)
        flops.append(counter.get_total_flops())
    assert flops[1] - flops[0] == policy_extra_flops(model.config, 3, policy, k)


def test_policy_bytes_by_hand():
    # Korthikanti et al. 2022: selective keeps everything but the a s^2 b attention terms
    cfg = GPTConfig(n_layer=2, dropout=0.1)
    b, s, a, h = 2, cfg.seq_len, cfg.n_head, cfg.d_model
    none = policy_saved_bytes(cfg, b, "none")
    assert none - policy_saved_bytes(cfg, b, "selective") == 2 * a * s * s * b * (4 + 1 + 4)
    assert (
        policy_saved_bytes(cfg, b, "every_k", 2)
        == policy_saved_bytes(cfg, b, "full") - 4 * b * s * h
    )
    # full recomputation is one extra forward of the blocks: 2 b s (12 h^2) + 4 b s^2 h each
    assert policy_extra_flops(cfg, b, "full") == 2 * (2 * b * s * 12 * h * h + 4 * b * s * s * h)


@pytest.mark.parametrize(
    "config",
    [
        dict(n_layer=5, batch=4, dropout=0.1),
        # long sequence, no dropout: selective's peak is in backward (the recomputed core)
        dict(n_layer=3, batch=2, dropout=0.0, seq_len=128, d_model=32, n_head=4),
        dict(n_layer=4, batch=2, dropout=0.1, seq_len=128, d_model=32, n_head=2),
    ],
)
def test_policy_peak_bytes_is_the_measured_peak(config):
    model, idx, targets = tiny_setup(**config)
    cases = [("none", 1), ("full", 1), ("every_k", 2), ("every_k", 3), ("selective", 1),
             ("segments", 2), ("segments", 3)]
    for policy, k in cases:
        measured = track_step(set_checkpointing(copy.deepcopy(model), policy, k), idx, targets).peak
        predicted = policy_peak_bytes(model.config, idx.shape[0], policy, k)
        assert predicted == measured, (config, policy, k, predicted, measured)
        assert predicted >= policy_saved_bytes(model.config, idx.shape[0], policy, k)


def test_set_checkpointing_is_reversible_and_validates(gpt):
    model, idx, targets = gpt
    m = copy.deepcopy(model)
    keys = list(m.state_dict())
    set_checkpointing(m, "selective")
    set_checkpointing(m, "full")
    assert list(m.state_dict()) == keys
    assert m.blocks[0].attn.attention_fn is naive_attention
    assert m.block_loop is not None  # only the block loop changes, no method of the model
    assert not {"run_blocks", "forward"} & set(vars(m))
    set_checkpointing(m, "none")
    assert m.block_loop is None
    with pytest.raises(ValueError, match="'partial'"):
        set_checkpointing(m, "partial")
    with pytest.raises(ValueError, match="0"):
        set_checkpointing(m, "every_k", 0)
    with pytest.raises(ValueError, match="-1"):
        policy_saved_bytes(m.config, 2, "every_k", -1)
    with pytest.raises(ValueError, match="9"):
        policy_extra_flops(m.config, 2, "segments", 9)
    with pytest.raises(TypeError, match="Linear"):
        set_checkpointing(nn.Linear(2, 2), "full")


# ---------------------------------------------------------------------------- vs torch
def _torch_policy(model, policy, k):
    """The same policies written with torch.utils.checkpoint (reentrant), the oracle."""
    model = copy.deepcopy(model)
    if policy == "selective":

        def attention(q, kk, v, causal=True, dropout_p=0.0, training=False):
            return torch_checkpoint(
                naive_attention, q, kk, v, causal, dropout_p, training, use_reentrant=True
            )

        set_attention_fn(model, attention)
    elif policy == "full":

        def every_block(blocks, x):
            for block in blocks:
                x = torch_checkpoint(block, x, use_reentrant=True)
            return x

        model.block_loop = every_block
    else:
        model.block_loop = lambda blocks, x: torch_checkpoint_sequential(
            blocks, k, x, use_reentrant=True
        )
    return model


@pytest.mark.parametrize("policy,k", [("full", 1), ("selective", 1), ("segments", 2)])
def test_saved_and_peak_bytes_match_torch_checkpoint(gpt, policy, k):
    model, idx, targets = gpt
    ours = set_checkpointing(copy.deepcopy(model), policy, k)
    theirs = _torch_policy(model, policy, k)
    torch.manual_seed(7)
    mine = saved_activation_bytes(ours.loss, idx, targets)
    torch.manual_seed(7)
    assert mine == saved_activation_bytes(theirs.loss, idx, targets)
    assert track_step(ours, idx, targets).peak == track_step(theirs, idx, targets).peak
    _, g1, _ = _step(ours, idx, targets)
    _, g2, _ = _step(theirs, idx, targets)
    assert all(torch.equal(g1[n], g2[n]) for n in g1)


def test_live_tracker_agrees_with_saved_activation_bytes(gpt):
    model, idx, targets = gpt
    for policy in ("none", "full"):
        m = set_checkpointing(copy.deepcopy(model), policy)
        tracker = LiveSavedBytes(m.parameters())
        torch.manual_seed(7)
        with tracker:
            loss = m.loss(idx, targets)
            at_end_of_forward = tracker.live
            loss.backward()
            del loss
        torch.manual_seed(7)
        assert at_end_of_forward == saved_activation_bytes(m.loss, idx, targets)
        assert tracker.live == 0 and tracker.timeline[-1] == ("forward", 0)
        if policy == "full":  # recomputing one block goes above the end-of-forward level
            assert tracker.peak > at_end_of_forward


# ----------------------------------------------------------------------------- other streams
class OwnStream(nn.Module):
    """Dropout drawing from the module's own generator (as tensor parallelism's per-rank
    stream does, chapter 6): torch's default generator knows nothing of it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8, dtype=torch.float64)
        self.gen = torch.Generator().manual_seed(5)

    def forward(self, x):
        h = self.lin(x)
        keep = torch.rand(h.shape, generator=self.gen, dtype=h.dtype) >= 0.5
        return torch.tanh(h * keep * 2.0)


def _own_stream_run(checkpointed):
    torch.manual_seed(0)
    layers = [OwnStream() for _ in range(3)]
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    results = []
    for _ in range(2):  # the second step: the streams went on as if nothing was recomputed
        for p in [x, *(q for m in layers for q in m.parameters())]:
            p.grad = None
        h = checkpoint_sequential(layers, 3, x) if checkpointed else run_in_order(layers)(x)
        h = checkpoint(layers[0], h) if checkpointed else layers[0](h)  # a module as fn
        h.square().sum().backward()
        results.append([h.detach(), x.grad, *(q.grad for m in layers for q in m.parameters())])
    return results, [m.gen.get_state() for m in layers]


def test_recompute_replays_the_streams_of_the_modules_it_runs():
    """Issue 26: the recompute replayed torch's generators only, so a module drawing from its
    own stream got another mask in backward. Reference: the same layers without checkpoint."""
    (plain, plain_streams), (ours, our_streams) = _own_stream_run(False), _own_stream_run(True)
    for step, (want, got) in enumerate(zip(plain, ours)):
        for i, (a, b) in enumerate(zip(want, got)):
            err = (a - b).abs().max().item()
            assert err <= 1e-12, f"step {step}, tensor {i}: checkpointed differs by {err}"
    for a, b in zip(plain_streams, our_streams):
        assert torch.equal(a, b), "the recompute must leave each stream where the forward left it"


def test_forward_states_finds_holders_once():
    from minitrain.checkpointing import forward_states

    m = OwnStream()
    shared = nn.Sequential(m, m)
    shared.other = m.gen  # the same generator held twice
    assert forward_states(shared, m) == [m.gen]
    assert forward_states(lambda x: x) == []
