"""Cutting the course's GPT into pipeline stages: which blocks each virtual stage holds.

Chapter 7, notebooks/07_pipeline_parallel.ipynb. ``split_blocks`` spreads ``L`` blocks over
``V = p * v`` virtual stages as evenly as possible (the first ``L mod V`` get one extra: the
last stage already carries the head and the loss); ``StageChunk`` is one virtual stage — its
blocks as ``.blocks`` with a ``run_blocks`` loop and a ``block_loop`` (so chapter 3's
``set_checkpointing`` applies to it), the embedding if it is the first, the head and the
model's loss if it is the last. GPipe
(Huang et al. 2019, section 2.1) and Megatron-LM (Narayanan et al. 2021, section 2.2) split
the layers the same way.
"""

from __future__ import annotations

from torch import nn

from minitrain.model import lm_loss


def split_blocks(num_layers: int, num_virtual_stages: int) -> list[range]:
    """Block indices of each virtual stage: as even as possible, extras to the first ones."""
    if num_layers < num_virtual_stages:
        raise ValueError(f"a pipeline of {num_virtual_stages} (virtual) stages needs at least "
                         f"{num_virtual_stages} blocks, but the model has {num_layers}")
    base, extra = divmod(num_layers, num_virtual_stages)
    out, start = [], 0
    for k in range(num_virtual_stages):
        size = base + (k < extra)
        out.append(range(start, start + size))
        start += size
    return out


class StageChunk(nn.Module):
    """One virtual stage: its blocks (``.blocks``, ``run_blocks``, ``block_loop`` — so chapter
    3's ``set_checkpointing`` applies to it), plus the embedding if first, the head if last."""

    def __init__(self, gpt: nn.Module, indices: range, first: bool, last: bool):
        super().__init__()
        self.blocks = nn.ModuleList(gpt.blocks[i] for i in indices)
        self.__dict__["gpt"] = gpt  # not a submodule: the stage owns the parameters once
        self.first, self.last = first, last
        self.block_loop = None  # as the GPT's: chapter 3's checkpointing policies set it

    def run_blocks(self, x):
        if self.block_loop is not None:
            return self.block_loop(self.blocks, x)
        for block in self.blocks:
            x = block(x)
        return x

    def embed(self, idx, positions=None):
        """The first virtual stage's own input activation: the embedding of the tokens (made
        to require grad if the embedding has no parameters, so B has something to reach);
        ``positions`` as ``GPT.embed``'s (a context-parallel shard's, chapter 11)."""
        x = self.gpt.embed(idx, positions)
        return x if x.requires_grad else x.requires_grad_()

    def forward(self, x):
        return self.run_blocks(x)

    def loss(self, h, targets):
        # the GPT's own loss (tensor parallelism's is over this rank's vocabulary slice)
        return getattr(self.gpt, "loss_fn", lm_loss)(self.gpt.logits(h), targets)
