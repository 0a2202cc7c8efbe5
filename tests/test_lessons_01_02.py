"""The rules chapters 1 and 2 teach, checked where they were once taught wrong (issue 43).

- Chapter 2, loss scaling: with the loss computed in fp32 (the logits cast before the
  cross-entropy, as Micikevicius et al. 2018 §3.3 and torch.autocast do), the course's
  ``DynamicLossScaler`` trains an fp16 model at S = 2^16 ... 2^24 without a single overflow;
  "S <= 2^15" held only for a loss computed in fp16 (kept as the pitfall).
- Chapter 1, model states: 16 (fp32), 18 (16-bit weights + fp32 gradients, Megatron's
  ``main_grad``) and 20 (16-bit weights and gradients + fp32 master and gradient copy) bytes
  per parameter, by ``estimate_training_memory(..., precision=...)``; and the 18 is what the
  course's ``MasterWeightOptimizer`` really keeps.
- The notebooks no longer say what was wrong.
"""

import json
from pathlib import Path

import pytest
import torch

from minitrain.data import MarkovChainData
from minitrain.memory import BYTES_PER_PARAMETER, estimate_training_memory
from minitrain.model import GPT, GPTConfig, lm_loss
from minitrain.precision import DynamicLossScaler, MasterWeightOptimizer, fp32_lm_loss

ROOT = Path(__file__).resolve().parents[1]
DEVICE = torch.device("cpu")  # fp16 on the CPU, as notebook 02 runs it


def _train_fp16(scaler, steps, loss_fn=fp32_lm_loss, loss_factor=1.0):
    """The tiny GPT in fp16 with fp32 masters, as notebook 02 trains it; returns the losses and
    how many steps the scaler skipped (S fell after them)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig()).to(device=DEVICE, dtype=torch.float16)
    model.loss_fn = loss_fn
    opt = MasterWeightOptimizer(model, torch.optim.AdamW, lr=3e-3, eps=1e-8 * loss_factor)
    data = MarkovChainData()
    losses, skipped = [], 0
    for step in range(steps):
        x, y = data.get_batch(step, 8, device=DEVICE)
        loss = model.loss(x, y)
        opt.zero_grad()
        before = scaler.get_scale()
        scaler.scale(loss * loss_factor).backward()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < before
        losses.append(loss.item())
    return losses, skipped


@pytest.mark.parametrize("log2_scale", [16, 20, 24])
def test_fp32_loss_scaler_trains_at_large_scales_without_overflow(log2_scale):
    # Gradients 2^18 smaller than the tiny GPT's (a large model's): the regime scaling is for.
    scaler = DynamicLossScaler(init_scale=2.0**log2_scale, growth_interval=10**6)
    losses, skipped = _train_fp16(scaler, steps=8, loss_factor=2.0**-18)
    assert skipped == 0, f"S = 2^{log2_scale} overflowed {skipped} times with an fp32 loss"
    assert scaler.get_scale() == 2.0**log2_scale
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3, losses  # it trains


def test_fp32_loss_scaler_at_gradscalers_default_start_is_clean():
    # The tiny GPT's own gradients, S = 2^16 (GradScaler's default start): no overflow.
    scaler = DynamicLossScaler(init_scale=2.0**16, growth_interval=10**6)
    _, skipped = _train_fp16(scaler, steps=4)
    assert skipped == 0


def test_fp16_loss_is_the_pitfall_that_caps_the_scale():
    # The loss computed in fp16: d(S*L)/dL = S is an fp16 number, and 2^16 is inf at once.
    scaler = DynamicLossScaler(init_scale=2.0**16, growth_interval=10**6)
    _, skipped = _train_fp16(scaler, steps=1, loss_fn=lm_loss)
    assert skipped == 1


def test_fp32_lm_loss_is_fp32_and_equals_the_loss_of_the_cast_logits():
    logits = torch.randn(2, 5, 7, device=DEVICE).half()
    targets = torch.randint(0, 7, (2, 5), device=DEVICE)
    loss = fp32_lm_loss(logits, targets)
    assert loss.dtype == torch.float32
    assert torch.equal(loss, lm_loss(logits.float(), targets))


@pytest.mark.parametrize(
    "precision, per_parameter", [("fp32", 16), ("mixed_fp32_grads", 18), ("mixed", 20)]
)
def test_estimate_training_memory_recipes(precision, per_parameter):
    n = 1_000_003
    est = estimate_training_memory(n, precision=precision)
    assert est["total"] == per_parameter * n
    assert sum(v for k, v in est.items() if k != "total") == est["total"]
    assert est["optimizer"] == 8 * n  # Adam's two fp32 moments in every recipe
    parts = BYTES_PER_PARAMETER[precision]
    if precision == "mixed_fp32_grads":  # Megatron's main_grad: fp32 gradients, no extra copy
        assert (parts["weights"], parts["gradients"], parts["gradient_accumulation"]) == (2, 4, 0)


def test_estimate_training_memory_default_is_still_fp32():
    assert estimate_training_memory(1000) == estimate_training_memory(1000, precision="fp32")


def test_master_weight_optimizer_keeps_the_18_byte_recipe():
    # bf16 weights; after backward the 16-bit gradients are gone, moved into fp32 master
    # gradients; AdamW's moments are fp32: 2 + 4 + 4 + 8 bytes per parameter.
    torch.manual_seed(0)
    model = GPT(GPTConfig()).to(device=DEVICE, dtype=torch.bfloat16)
    model.loss_fn = fp32_lm_loss
    opt = MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-3)
    x, y = MarkovChainData().get_batch(0, 4, device=DEVICE)
    for _ in range(2):
        opt.zero_grad()
        model.loss(x, y).backward()
        opt.step()
    n = sum(p.numel() for p in model.parameters())
    kept = sum(p.nbytes for p in model.parameters())
    kept += sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    kept += sum(m.nbytes + m.grad.nbytes for m in opt.master_params)
    kept += sum(t.nbytes for s in opt.optimizer.state.values() for t in s.values() if t.dim() > 0)
    assert kept == estimate_training_memory(n, precision="mixed_fp32_grads")["total"]


def _notebook(name):
    return json.loads((ROOT / "notebooks" / name).read_text())


def _notebook_text(name):
    return "\n".join("".join(c["source"]) for c in _notebook(name)["cells"])


def _notebook_outputs(name):
    return "\n".join("".join(o.get("text", "")) for c in _notebook(name)["cells"]
                     for o in c.get("outputs", []))


def test_notebook_02_teaches_the_fp32_loss_not_the_fp16_ceiling():
    text = _notebook_text("02_floating_point_and_loss_scaling.ipynb")
    for wrong in ("S ≤ 2^15", "must be representable in fp16", "not a property of the gradients",
                  "flush everything below 2^-24", "(Micikevicius et al. 2018, §3.2): start high",
                  "recovers 40.96 to four digits"):
        assert wrong not in text, wrong
    for right in ("fp32_lm_loss", "torch.autocast", "torch.amp.GradScaler", "Pitfall",
                  "2^-25", "14 bits", "DeepSeek-V3"):
        assert right in text, right
    # what the committed run printed: the fp32-loss scaler, clean from 2^16 through 2^24
    out = _notebook_outputs("02_floating_point_and_loss_scaling.ipynb")
    assert "training clean steps at every scale 2^16 ... 2^24: True" in out
    assert "fp32 loss          , S = 2^16: first gradient of backward 65536.0" in out
    assert "by hand : every step at S = 2^16 was clean (2^16 is no fp16 number): True" in out


def test_notebook_01_attributes_the_flops_and_names_the_three_recipes():
    text = _notebook_text("01_single_device_training.ipynb")
    assert "(Kaplan et al. 2020; PaLM" not in text  # 6N + 12Lhs is PaLM's, not Kaplan's
    assert "6N + 6·n_layer·n_ctx·d_attn" in text and "appendix B" in text
    assert "about 2 expected" not in text
    for recipe in ('"fp32"', '"mixed_fp32_grads"', '"mixed"', "main_grad"):
        assert recipe in text, recipe
    assert "tokens are wasted. Three runs" not in text  # §9 no longer concludes untuned
