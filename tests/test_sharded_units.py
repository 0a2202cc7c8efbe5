"""Stage 3's units when parameters sit in containers (issue 26, item 1), for ZeRO-3 and FSDP.

A trunk and one branch per rank, the branches in an ``nn.ModuleList``, an ``nn.ModuleDict`` of
``nn.Sequential`` branches, or an ``nn.Sequential`` indexed like a list (tests/toy_models.py
``Branched``): units taken from ``module.children()`` were containers whose forward never
runs, so their parameters were never gathered and the forward read freed memory (NaN after 3
SGD steps). Checked against one process training on the mean of the ranks' losses (float64,
SGD with lr = 1 and AdamW), and: a parameter used while its unit is not gathered raises an
error that names it.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from toy_models import Branched, toy_batch

from minitrain.runtime import launch
from minitrain.zero.units import default_units

STEPS, KINDS = 3, ("list", "dict", "seq")
OPTIMIZERS = {"sgd": (torch.optim.SGD, dict(lr=1.0)), "adamw": (torch.optim.AdamW, dict(lr=1e-2))}
# float64 throughout: the ranks' sum differs from one process's in the order of additions
# only, ~1e-16 relative; a unit gathered late, from another unit, or not at all is off by O(1)
TOL = 1e-9


def _batch(step, rank, world):
    x, y = toy_batch(step, rank, world)
    return x.double(), y.double()


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _model(kind, world):
    """World + 1 branches: rank r uses branch r, the last branch no rank uses."""
    torch.manual_seed(0)
    return Branched(kind, world + 1).double()


def _reference(kind, world, opt_name, zero_fill):
    """One process on the mean of the ranks' losses. ``zero_fill``: the branch no rank used
    gets a zero gradient (ZeRO's flat shards cannot tell unused from zero; AdamW then decays
    it); else its ``.grad`` stays None (FSDP, for a unit no rank used)."""
    cls, kw = OPTIMIZERS[opt_name]
    model = _model(kind, world)
    opt = cls(model.parameters(), **kw)
    for s in range(STEPS):
        opt.zero_grad()
        loss = sum(_mse(model(_batch(s, r, world)[0], r), _batch(s, r, world)[1])
                   for r in range(world))  # fmt: skip
        (loss / world).backward()
        for p in model.parameters() if zero_fill else ():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _wrap(which, model, opt_name, units=None):
    from minitrain.fsdp import FullyShardedDataParallel
    from minitrain.zero import ZeroDataParallel

    cls, kw = OPTIMIZERS[opt_name]
    if which == "zero":
        wrapped = ZeroDataParallel(model, cls, 3, units=units, **kw)
        return wrapped, wrapped, lambda: None
    wrapped = FullyShardedDataParallel(model, units=units)
    return wrapped, cls(wrapped.parameters(), **kw), wrapped.finish_gradient_synchronization


def _train(cases):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for which, kind, opt_name, override in cases:
        model = _model(kind, world)
        units = [model.trunk, *model.branches] if override else None  # the trunk: one unit
        wrapped, opt, finish = _wrap(which, model, opt_name, units)
        for s in range(STEPS):
            x, y = _batch(s, rank, world)
            opt.zero_grad()
            _mse(wrapped(x, rank), y).backward()
            finish()
            opt.step()
        out[(which, kind, opt_name, override)] = wrapped.full_state_dict()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_container_models_match_one_process(world):
    cases = [(w, k, o, False) for w in ("zero", "fsdp") for k in KINDS for o in OPTIMIZERS]
    cases += [(w, "list", "sgd", True) for w in ("zero", "fsdp")]  # units= still honoured
    refs = {(k, o, w): _reference(k, world, o, zero_fill=w == "zero")
            for w in ("zero", "fsdp") for k in KINDS for o in OPTIMIZERS}  # fmt: skip
    for kind in KINDS:  # the reference moved every parameter but the unused branch's
        unused = f"branches.{'b' if kind == 'dict' else ''}{world}."
        start = dict(_model(kind, world).named_parameters())
        moved = {n: (refs[(kind, "sgd", "zero")][n] - p).abs().max().item() for n, p in start.items()}
        assert all(d > 1e-3 for n, d in moved.items() if not n.startswith(unused)), moved
    for rank, results in enumerate(launch(_train, world, cases, timeout=240)):
        for (which, kind, opt_name, override), state in results.items():
            ref = refs[(kind, opt_name, which)]
            assert list(state) == list(ref)
            for name, want in ref.items():
                err = (state[name] - want).abs().max().item()
                assert err <= TOL, (
                    f"{which} world {world} rank {rank}, {kind} branches, {opt_name}"
                    f"{', units=' if override else ''}: {name} differs from one process by {err:.3g}"
                )


def test_default_units_are_modules_whose_forward_runs():
    model = Branched("dict", 3)
    units = default_units(model)
    names = {id(m): n for n, m in model.named_modules()}
    assert [names[id(m)] for m in units] == [
        "inp", "trunk.0", "trunk.1", "trunk.2",
        *(f"branches.b{i}.{j}" for i in range(3) for j in range(3)),
    ]  # fmt: skip
    from minitrain.model import GPT, GPTConfig

    gpt = GPT(GPTConfig(vocab_size=8, seq_len=4, n_layer=2, n_head=1, d_model=4))
    assert default_units(gpt) == list(gpt.blocks)  # a GPT: one unit per block, as before


# --------------------------------------------------------------------------- misuse is named
class _ReadsAcross(Branched):
    """Reads a branch's weight in the root's forward, outside that branch's own forward:
    ``read`` "prefetched" (branch 0's, whose gather is in flight as the trunk ends) or "sum"
    (a penalty on branch 2's, freed: a reduction of nothing would silently be 0)."""

    def __init__(self, read):
        super().__init__("list", 3)
        self.read = read

    def forward(self, x, branch):
        h = self.trunk(torch.tanh(self.inp(x)))
        if self.read == "prefetched":
            return F.linear(h, self.branches[0].weight) * self.gain
        return self.branch(branch)(h) * self.gain + self.branches[2].weight.pow(2).sum()


def _misuse(which, how):
    """(error type, message with notes) on this rank: ``how`` "units" (the branches'
    ModuleList given as a unit: its forward never runs), or ``_ReadsAcross``'s reads."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = (Branched("list", 3) if how == "units" else _ReadsAcross(how)).double()
    units = [model.inp, model.trunk, model.branches] if how == "units" else None
    wrapped, _, finish = _wrap(which, model, "sgd", units)
    x, y = _batch(0, rank, 2)
    try:
        _mse(wrapped(x, rank), y).backward()
        finish()
    except RuntimeError as exc:
        return type(exc).__name__, "\n".join([str(exc), *getattr(exc, "__notes__", [])])
    return None, "no error"


@pytest.mark.parametrize("which", ["zero", "fsdp"])
def test_a_parameter_used_while_its_unit_is_not_gathered_is_named(which):
    for rank, (kind, message) in enumerate(launch(_misuse, 2, which, "units", timeout=120)):
        # the module that uses it checks: the precise parameter, in named_parameters() terms
        assert kind == "UngatheredParameterError", message
        assert f"parameter 'branches.{rank}.weight'" in message, message
    for kind, message in launch(_misuse, 2, which, "prefetched", timeout=120):
        # read directly while its gather is in flight: it holds no data yet, the op fails
        # (never computes on a buffer being written); the error lists what was not gathered
        assert kind is not None and "branches.0.weight" in message, message
    for kind, message in launch(_misuse, 2, which, "sum", timeout=120):
        # a reduction of nothing runs (it is 0), but its gradient gives it away in backward
        assert kind == "UngatheredParameterError", message
        assert "parameter 'branches.2.weight'" in message, message
