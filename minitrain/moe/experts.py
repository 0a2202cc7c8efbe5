"""The experts: E feed-forward networks held as stacked weights (chapter 8, notebook 08).

Each expert is the course GPT's MLP, fc_out(GELU(fc_in(x))) (Shazeer et al. 2017: the
experts are ordinary feed-forward networks). Their weights are stacked along a leading
expert dimension, (E, d_model, d_ff) and so on, so expert parallelism hands rank p the
contiguous slice of experts [p·E/P, (p+1)·E/P) by slicing, and a rank's experts run as one
loop over *experts* (never over tokens) on contiguous blocks of rows (``dispatch.py``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from minitrain.runtime.rank import get_device


def factory_kwargs(device=None, dtype=None) -> dict:
    """``device=``/``dtype=`` for new parameters, honoured as torch modules honour them; without
    ``device=``, built where they will live: this rank's device, ``get_device()`` (issue 29),
    never on the CPU and moved after — on a GPU the weights are born on it. A caller passes
    tokens on the layer's device (drawn on the CPU for device-independent numbers, then moved
    to ``get_device()``), or builds the layer with ``device=x.device`` (issue 41)."""
    return {"device": torch.device(device) if device is not None else get_device(),
            "dtype": dtype}


class Experts(nn.Module):
    """``num_experts`` MLPs d_model → d_ff → d_model with stacked weights."""

    def __init__(self, num_experts: int, d_model: int, d_ff: int, device=None, dtype=None):
        super().__init__()
        self.num_experts, self.d_model, self.d_ff = num_experts, d_model, d_ff
        kw = factory_kwargs(device, dtype)
        self.w_in = nn.Parameter(torch.empty(num_experts, d_model, d_ff, **kw))
        self.b_in = nn.Parameter(torch.zeros(num_experts, d_ff, **kw))
        self.w_out = nn.Parameter(torch.empty(num_experts, d_ff, d_model, **kw))
        self.b_out = nn.Parameter(torch.zeros(num_experts, d_model, **kw))
        # nn.Linear's default scale, per expert: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        nn.init.uniform_(self.w_in, -1 / math.sqrt(d_model), 1 / math.sqrt(d_model))
        nn.init.uniform_(self.w_out, -1 / math.sqrt(d_ff), 1 / math.sqrt(d_ff))

    def forward(self, sorted_rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Run expert e on the e-th block of ``counts[e]`` rows (rows grouped by expert)."""
        outs = []
        for e, block in enumerate(torch.split(sorted_rows, counts)):
            # an empty block still runs (0-row matmuls): an idle expert gets a zero
            # gradient rather than None, the same on every rank of expert parallelism
            hidden = F.gelu(block @ self.w_in[e] + self.b_in[e])
            outs.append(hidden @ self.w_out[e] + self.b_out[e])
        return torch.cat(outs) if outs else sorted_rows.new_zeros(0, self.d_model)

    def shard(self, first: int, count: int) -> Experts:
        """A copy holding experts [first, first + count) (same values, own parameters)."""
        part = Experts.__new__(Experts)
        nn.Module.__init__(part)
        part.num_experts, part.d_model, part.d_ff = count, self.d_model, self.d_ff
        for name in ("w_in", "b_in", "w_out", "b_out"):
            value = getattr(self, name).detach()[first:first + count].clone()
            setattr(part, name, nn.Parameter(value))
        return part

    def params_per_expert(self) -> int:
        return sum(p[0].numel() for p in self.parameters())
