"""Chapter 8's parts and tokens on one device (issue 41), by the rule of issue 29.

An MoE layer built without ``device=`` lives on ``get_device()`` (``cuda:r`` on a GPU rank),
so whoever builds one passes it tokens there: the tests, the graded tests and notebook 08 draw
their tokens on the CPU (the same numbers on every device) and move them to ``get_device()``.
Before issue 41 they passed CPU tokens to layers on the GPU ("Expected all tensors to be on the
same device"). ``device=`` is honoured as torch modules honour it: a layer built there computes
on tokens there, whatever ``get_device()`` says — expert parallelism too.

The CPU stand-in for the GPU rank: ``MINITRAIN_DEVICE=meta``, a ``get_device()`` that is not
the CPU. A meta tensor has no numbers, so the token helpers are called, not the tests.
"""

import copy
import importlib.util
import json
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from minitrain.moe import ExpertParallelMoE, MoELayer
from minitrain.runtime import get_device, launch

ROOT = Path(__file__).resolve().parent.parent
ELSEWHERE = "meta"  # what get_device() says here instead of a GPU rank's "cuda:r"


def _devices(*tensors) -> set[str]:
    return {t.device.type for t in tensors}


def _load(path: Path, name: str):
    """A test file as a module (its helpers, not its tests)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def elsewhere(monkeypatch):
    monkeypatch.setenv("MINITRAIN_DEVICE", ELSEWHERE)
    assert get_device().type == ELSEWHERE


# -------------------------------------------------------------------------------- the rule
def test_a_layer_built_without_device_lives_on_get_device(elsewhere):
    """Every parameter and buffer, the aux loss and a copy's (``from_local`` deep-copies the
    router) on ``get_device()``; ``device=`` overrides it."""
    layer = MoELayer(6, 10, 4, top_k=2, balancing="bias")
    assert _devices(*layer.parameters(), *layer.buffers(), layer.router.aux_loss,
                    copy.deepcopy(layer.router).aux_loss) == {ELSEWHERE}
    named = MoELayer(6, 10, 4, top_k=2, balancing="bias", device="cpu")
    assert _devices(*named.parameters(), *named.buffers(), named.router.aux_loss) == {"cpu"}


# ----------------------------------------------------------------- the callers' tokens
def _same_numbers_on_the_cpu(draw, want):
    """Without MINITRAIN_DEVICE the helper's tokens are the CPU generator's numbers."""
    got = draw()
    assert got.device.type == "cpu"
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_moe_tests_put_their_tokens_on_get_device(monkeypatch):
    import test_moe  # tests/ is on sys.path under pytest

    _same_numbers_on_the_cpu(lambda: test_moe._chunk(1, 5, 3),
                             torch.randn(5, 3, generator=torch.Generator().manual_seed(11)))
    monkeypatch.setenv("MINITRAIN_DEVICE", ELSEWHERE)
    generator = torch.Generator(device="cpu").manual_seed(0)
    made = {"tokens": test_moe.tokens(5, 3),
            "tokens(generator=)": test_moe.tokens(5, 3, generator=generator),
            "_chunk": test_moe._chunk(1, 5, 3)}
    assert {name: t.device.type for name, t in made.items()} == dict.fromkeys(made, ELSEWHERE)


def test_the_chapter_8_graded_tests_put_their_tokens_on_get_device(monkeypatch):
    graded = _load(ROOT / "tests/grading/test_ch08_mixture_of_experts.py", "graded_ch08_tokens")
    bughunt = _load(ROOT / "tests/grading/test_ch08_bughunt.py", "graded_ch08_bughunt_tokens")
    _same_numbers_on_the_cpu(lambda: graded._tokens(10, 6, 1),
                             torch.randn(10, 6, generator=torch.Generator().manual_seed(1)))
    _same_numbers_on_the_cpu(lambda: bughunt._tokens(21),
                             torch.randn(bughunt.T, bughunt.D,
                                         generator=torch.Generator().manual_seed(21)))
    monkeypatch.setenv("MINITRAIN_DEVICE", ELSEWHERE)
    made = {"mixture_of_experts._tokens": graded._tokens(10, 6, 1),
            "bughunt._tokens": bughunt._tokens(21)}
    assert {name: t.device.type for name, t in made.items()} == dict.fromkeys(made, ELSEWHERE)


def _calls(source: str, name: str) -> list[tuple[str, str]]:
    """Each call ``name(...)`` in ``source``: (the call, the text right after it)."""
    found = []
    for match in re.finditer(re.escape(name) + r"\(", source):
        depth, i = 0, match.end() - 1
        while True:
            depth += {"(": 1, ")": -1}.get(source[i], 0)
            i += 1
            if depth == 0:
                break
        found.append((source[match.start():i], source[i:i + 40]))
    return found


def test_notebook_08_puts_its_tokens_where_its_layers_are():
    """In every code cell that builds an MoE layer, each token tensor is drawn on the CPU and
    moved to ``get_device()`` (the cells need numbers: they are read, not run, here)."""
    notebook = json.loads((ROOT / "notebooks/08_mixture_of_experts.ipynb").read_text())
    cells = ["".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code"]
    with_layers = [c for c in cells if "MoELayer(" in c]
    assert len(with_layers) >= 3, "notebook 08's layer cells not found"
    stray = [call for cell in with_layers for call, after in _calls(cell, "torch.randn")
             if 'device="cpu"' not in call or not after.startswith(".to(get_device())")]
    assert not stray, f"tokens not moved to get_device(), where the layers are: {stray}"
    for cell in with_layers:  # a reference's own tensors follow the tokens
        for call, _ in _calls(cell, "torch.zeros"):
            assert "device=" in call, call


# ------------------------------------------------------------- device= honoured, as torch
@pytest.mark.parametrize("balancing", ["aux_loss", "bias"])
def test_a_layer_built_with_device_computes_there_whatever_get_device_says(balancing, monkeypatch):
    torch.manual_seed(0)
    reference = MoELayer(6, 10, 4, top_k=2, capacity_factor=1.0, balancing=balancing,
                         z_loss_weight=0.1, device="cpu")
    monkeypatch.setenv("MINITRAIN_DEVICE", ELSEWHERE)
    torch.manual_seed(0)
    layer = MoELayer(6, 10, 4, top_k=2, capacity_factor=1.0, balancing=balancing,
                     z_loss_weight=0.1, device="cpu")
    x = torch.randn(12, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y = layer(x)
    (y.square().sum() + layer.aux_loss).backward()
    layer.router.update_bias()
    assert _devices(*layer.parameters(), *layer.buffers(), *(p.grad for p in layer.parameters()),
                    y, x.grad, layer.aux_loss, layer.last_routing.load) == {"cpu"}
    torch.testing.assert_close(reference(x.detach()), y.detach(), rtol=0, atol=0)


def _expert_parallel_built_on_the_cpu():
    os.environ["MINITRAIN_DEVICE"] = ELSEWHERE  # this rank's device is "elsewhere"
    try:
        torch.manual_seed(0)
        local = MoELayer(6, 8, 4, top_k=2, capacity_factor=1.5, balancing="bias", device="cpu")
        ep = ExpertParallelMoE.from_local(local)
        x = torch.randn(10, 6, generator=torch.Generator().manual_seed(dist.get_rank()))
        want = local(x).detach()
        x.requires_grad_()
        y = ep(x)
        (y.square().sum() + ep.aux_loss).backward()
        ep.finish_gradient_synchronization()
        ep.update_bias()
        grads = [p.grad for p in ep.parameters()]
        return (sorted(_devices(y, x.grad, *ep.parameters(), *grads, *ep.buffers())),
                (y.detach() - want).abs().max().item())
    finally:
        del os.environ["MINITRAIN_DEVICE"]


def test_expert_parallel_built_with_device_computes_there_whatever_get_device_says():
    """The all-to-alls, the split check and the gradient sync run on the tokens' device."""
    for devices, diff in launch(_expert_parallel_built_on_the_cpu, 2, timeout=90):
        assert devices == ["cpu"] and diff < 1e-6, (devices, diff)
