"""Graded tests of chapter 1: parameter count, memory estimate, activation bytes, and
gradient accumulation, each checked against an independent reference (counting the
model's tensors, the published table, autograd's saved tensors, one big batch)."""

import pytest
import torch

import minitrain.memory as memory
import minitrain.model as model_mod
import minitrain.step as train_step_mod
from minitrain.model import GPT, Block, GPTConfig

PARAM_CONFIGS = [
    GPTConfig(),
    GPTConfig(vocab_size=50, seq_len=16, n_layer=3, n_head=2, d_model=32, d_ff=80),
    GPTConfig(vocab_size=17, seq_len=9, n_layer=1, n_head=3, d_model=12, bias=False),
    GPTConfig(vocab_size=100, seq_len=8, n_layer=2, n_head=4, d_model=16, tie_weights=True),
    GPTConfig(vocab_size=20, seq_len=8, n_layer=2, n_head=2, d_model=8, bias=False,
              moe_experts=3),
]


@pytest.mark.exercise("gpt_num_params", points=2)
@pytest.mark.parametrize("config", PARAM_CONFIGS, ids=["default", "d_ff", "no_bias", "tied", "experts"])
def test_gpt_num_params(config):
    counted = sum(p.numel() for p in GPT(config).parameters())  # each shared tensor once
    built = []
    real_init = GPT.__init__

    def recorded_init(self, *args, **kwargs):  # still builds it: only noted, then failed below
        built.append(True)
        real_init(self, *args, **kwargs)

    GPT.__init__ = recorded_init
    try:
        mine = model_mod.gpt_num_params(config)
    finally:
        GPT.__init__ = real_init
    assert not built, (
        "gpt_num_params built a GPT to count its parameters; count from the config alone "
        "(the chapter calls it for 7B-parameter configs no machine here can allocate)")
    assert mine == counted, (
        f"gpt_num_params gives {mine} for {config}, but the model has {counted} parameters"
    )


# params -> (fp32 GB, mixed GB), the standard table (GB = 1e9 bytes)
TABLE = {1e9: (16, 20), 7e9: (112, 140), 70e9: (1120, 1400), 405e9: (6480, 8100)}


@pytest.mark.exercise("estimate_training_memory", points=2)
@pytest.mark.parametrize("params", list(TABLE), ids=["1B", "7B", "70B", "405B"])
def test_estimate_training_memory(params):
    for precision, gb in zip(("fp32", "mixed"), TABLE[params]):
        est = memory.estimate_training_memory(int(params), precision)
        assert est["total"] == gb * 1e9, (
            f"estimate_training_memory for {params / 1e9:g}B parameters in {precision}: "
            f"total {est['total'] / 1e9:g} GB, "
            f"the table says {gb} GB"
        )
        parts = sum(v for k, v in est.items() if k != "total")
        assert parts == est["total"], (
            f"{precision}: the parts add up to {parts / 1e9:g} GB, not the total "
            f"{est['total'] / 1e9:g} GB"
        )
        want = {"fp32": (4, 4, 8, 0), "mixed": (2, 2, 8, 4)}[precision]
        got = tuple(est[k] / params for k in ("weights", "gradients", "optimizer", "master"))
        assert got == want, (
            f"{precision}: bytes per parameter for weights, gradients, optimizer, master are "
            f"{got}, expected {want}"
        )


def _measure_saved_bytes(fn, *args):
    """Independent measurement: distinct non-parameter storages autograd saves."""
    params = {
        p.untyped_storage().data_ptr()
        for m in args
        if isinstance(m, torch.nn.Module)
        for p in m.parameters()
    }
    if isinstance(fn, torch.nn.Module):
        params |= {p.untyped_storage().data_ptr() for p in fn.parameters()}
    storages = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(t.untyped_storage().nbytes() for t in storages.values())


@pytest.mark.exercise("block_activation_bytes", points=3)
@pytest.mark.parametrize(
    "b,s,h,a,f,p",
    [
        (2, 16, 64, 4, None, 0.0),
        (3, 32, 48, 6, None, 0.0),
        (1, 8, 32, 2, 80, 0.0),
        (4, 24, 64, 8, None, 0.1),
    ],
    ids=["small", "six_heads", "d_ff", "dropout"],
)
def test_block_activation_bytes(b, s, h, a, f, p):
    torch.manual_seed(0)
    block = Block(GPTConfig(seq_len=s, n_head=a, d_model=h, d_ff=f, dropout=p)).train()
    x = torch.randn(b, s, h, requires_grad=True)
    measured = _measure_saved_bytes(block, x)
    mine = memory.block_activation_bytes(b, s, h, a, f, p)
    assert mine == measured, (
        f"block_activation_bytes(b={b}, s={s}, h={h}, a={a}, d_ff={f}, dropout={p}) = {mine}, "
        f"but autograd saves {measured} bytes for that block"
    )


@pytest.mark.exercise("accumulate_gradients", points=3)
@pytest.mark.parametrize("rows,micro", [(6, 2), (6, 1), (5, 2)], ids=["3x2", "6x1", "2+2+1"])
def test_accumulate_gradients(rows, micro):
    torch.manual_seed(0)
    model = GPT(GPTConfig()).double()
    x, y = torch.randint(0, 64, (rows, 32)), torch.randint(0, 64, (rows, 32))
    # Reference: one big batch
    big = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    ref = torch.autograd.grad(big, list(model.parameters()))
    model.zero_grad(set_to_none=True)
    micro_batches = list(zip(x.split(micro), y.split(micro)))
    loss = train_step_mod.accumulate_gradients(model, micro_batches)
    assert loss == pytest.approx(big.item(), rel=1e-9), (
        f"accumulate_gradients returned loss {loss:.6f} for {len(micro_batches)} micro-batches; "
        f"the mean loss of the whole batch is {big.item():.6f} (is each micro-batch loss "
        f"weighted by its share of the tokens?)"
    )
    for (name, p), r in zip(model.named_parameters(), ref):
        assert p.grad is not None, f"{name} has no gradient after accumulate_gradients"
        err = (p.grad - r).abs().max().item()
        assert err < 1e-9, (
            f"{name}: accumulated gradient differs from the one-big-batch gradient by {err:.3g} "
            f"(is each micro-batch loss scaled by its share of the tokens?)"
        )


class _Watched(torch.nn.Module):
    """The model, noting for every forward whether the previous output's backward has run."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.pending = inner, []

    def forward(self, x):
        if self.pending and not self.pending[-1]["reached"]:
            self.pending[-1]["late"] = True
        out = self.inner(x)
        note = {"reached": False, "late": False}
        out.register_hook(lambda g: note.__setitem__("reached", True))
        self.pending.append(note)
        return out


@pytest.mark.exercise("accumulate_gradients", points=1)
def test_accumulate_gradients_backwards_each_micro_batch_before_the_next():
    torch.manual_seed(0)
    model = _Watched(GPT(GPTConfig()))
    x, y = torch.randint(0, 64, (6, 32)), torch.randint(0, 64, (6, 32))
    train_step_mod.accumulate_gradients(model, list(zip(x.split(2), y.split(2))))
    late = [i for i, note in enumerate(model.pending[:-1]) if note["late"]]
    assert not late, (
        f"accumulate_gradients ran the forward of micro-batch {late[0] + 1} before the backward of "
        f"micro-batch {late[0]}: every graph stayed alive until the end, so memory grows with the "
        f"number of micro-batches — backward each one before the next forward")


@pytest.mark.exercise("estimate_training_memory", points=1)
@pytest.mark.parametrize("bad", [
    dict(num_params=1000, precision="fp64x"), dict(num_params=1000, precision="FP32"),
    dict(num_params=-5, precision="fp32"), dict(num_params=2.5, precision="fp32"),
], ids=["unknown precision", "misspelt precision", "negative count", "fractional count"])
def test_estimate_training_memory_rejects_bad_input(bad):
    try:
        got = memory.estimate_training_memory(**bad)
    except ValueError as exc:
        named = repr(bad["precision"]) if "precision" in str(exc) else None
        assert named is None or named in str(exc) or bad["precision"] in str(exc), (
            f"estimate_training_memory({bad}): the ValueError should name the value given; "
            f"it says {exc}")
        return
    except NotImplementedError:
        raise
    except Exception as exc:
        raise AssertionError(
            f"estimate_training_memory({bad}) raised {type(exc).__name__}: {exc} — bad input "
            f"must raise ValueError naming it (a KeyError from a dict lookup tells the caller "
            f"nothing; check the input before using it)") from None
    raise AssertionError(
        f"estimate_training_memory({bad}) returned {got} — bad input must raise ValueError "
        f"naming it")
