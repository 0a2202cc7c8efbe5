"""FP8 training: per-tensor scaling by amax, current and delayed, and a simulated FP8 linear layer.

Chapter 2, notebooks/02_floating_point_and_loss_scaling.ipynb (built on minitrain.precision.formats).
Micikevicius et al. 2022, "FP8 Formats for Deep Learning": E4M3 for weights and activations,
E5M2 for gradients, each tensor multiplied by a scale so its largest magnitude (amax) lands
near the format's max. Delayed scaling takes the scale from an amax history of earlier steps
(as NVIDIA Transformer Engine's DelayedScaling recipe). The layer's values are exactly fp8
(``FloatFormat.round``) and its matmuls accumulate in fp32 — what fp8 tensor cores do —
so ``torch._scaled_mm`` serves as the test oracle.
"""

from __future__ import annotations

from collections import deque

import torch
from torch import nn

from minitrain.precision.formats import FP8_E4M3, FP8_E5M2, FloatFormat


def amax_scale(amax: torch.Tensor, fmt: FloatFormat, margin: int = 0) -> torch.Tensor:
    """scale = fmt.max / (amax * 2**margin): x * scale then spans the format's range without
    overflowing (per-tensor scaling, Micikevicius et al. 2022). amax of 0 or inf/NaN gives scale 1."""
    # a number (a delayed amax from the history) becomes a CPU scalar; a tensor keeps its device
    amax = (amax.float() if torch.is_tensor(amax)
            else torch.tensor(amax, dtype=torch.float32, device="cpu"))
    ok = torch.isfinite(amax) & (amax > 0)
    return torch.where(ok, fmt.max / (amax.clamp(min=1e-30) * 2.0**margin), 1.0)


def quantize(x: torch.Tensor, fmt: FloatFormat, scale) -> torch.Tensor:
    """The values fmt stores for x * scale, saturating at +-max (the float8 casts of FP8
    training recipes saturate, so a stale delayed scale cannot produce inf)."""
    y = (x.float() * scale).clamp(-fmt.max, fmt.max)
    return fmt.round(y)


class DelayedScaling:
    """Scale from the largest amax of the previous `history_len` steps (Transformer Engine's
    delayed scaling): the cast needs no extra pass over the tensor before it, at the risk of
    saturating when amax jumps. The first call, with an empty history, uses the current amax."""

    def __init__(self, fmt: FloatFormat, history_len: int = 16, margin: int = 0):
        if history_len < 1:
            raise ValueError(f"history_len must be >= 1, got {history_len!r}")
        self.fmt, self.margin = fmt, margin
        self.history: deque[float] = deque(maxlen=history_len)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        amax = x.detach().abs().max().float()
        past = max(self.history) if self.history else float(amax)
        self.history.append(float(amax))
        return amax_scale(torch.tensor(past, device=x.device), self.fmt, self.margin)


class _QuantizedMatmul(torch.autograd.Function):
    """y = x w^T with x, w cast to the forward format and dy to the backward format, each with
    its own per-tensor scale; products accumulate in fp32, as tensor cores do."""

    @staticmethod
    def forward(ctx, x, weight, layer):
        xq, sx = layer.cast(x, "input")
        wq, sw = layer.cast(weight, "weight")
        ctx.save_for_backward(xq, wq, sx, sw)  # the low-precision copies, not x and w
        ctx.layer = layer
        return (xq @ wq.t()) / (sx * sw)

    @staticmethod
    def backward(ctx, grad_out):
        xq, wq, sx, sw = ctx.saved_tensors
        gq, sg = ctx.layer.cast(grad_out, "grad")
        grad_x = (gq @ wq) / (sg * sw)
        grad_w = gq.reshape(-1, gq.shape[-1]).t() @ xq.reshape(-1, xq.shape[-1]) / (sg * sx)
        return grad_x, grad_w, None


class QuantizedLinear(nn.Linear):
    """nn.Linear whose matmuls see inputs and weights in `forward_format` and output gradients
    in `backward_format` (E4M3 / E5M2 by default: precision forward, range backward), simulated
    with `FloatFormat.round`. The weight stays an fp32 parameter (the master copy).
    `scaling`: "current" (amax of this tensor now), "delayed" (amax history) or None (scale 1,
    enough for bf16's range)."""

    def __init__(
        self,
        in_features,
        out_features,
        bias=True,
        forward_format=FP8_E4M3,
        backward_format=FP8_E5M2,
        scaling: str | None = "current",
        history_len=16,
    ):
        super().__init__(in_features, out_features, bias=bias)
        if scaling not in ("current", "delayed", None):
            raise ValueError(f"scaling must be 'current', 'delayed' or None, got {scaling!r}")
        self.formats = {"input": forward_format, "weight": forward_format, "grad": backward_format}
        self.scaling = scaling
        self.scalers = {
            role: DelayedScaling(fmt, history_len) for role, fmt in self.formats.items()
        }

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kw) -> QuantizedLinear:
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, **kw)
        layer.load_state_dict(linear.state_dict())
        return layer

    def cast(self, t: torch.Tensor, role: str):
        fmt = self.formats[role]
        if self.scaling is None:
            scale = torch.tensor(1.0, device=t.device)
        elif self.scaling == "current":
            scale = amax_scale(t.detach().abs().max(), fmt)
        else:
            scale = self.scalers[role](t)
        return quantize(t, fmt, scale), scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _QuantizedMatmul.apply(x, self.weight, self)
        return y if self.bias is None else y + self.bias  # the bias add stays in high precision


def quantize_linears(model: nn.Module, exclude: tuple[str, ...] = (), **kw) -> nn.Module:
    """Replace (in place) every nn.Linear of `model` whose name is not in `exclude` by a
    QuantizedLinear with the same weights; `kw` go to QuantizedLinear. Returns the model."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is nn.Linear and full not in exclude:
                setattr(module, child_name, QuantizedLinear.from_linear(child, **kw))
    return model
