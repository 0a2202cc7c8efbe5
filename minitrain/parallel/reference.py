"""The reference every layout is compared with: the dense GPT trained on one process.

Chapter 11, notebooks/11_putting_it_together.ipynb (and the capstone's tests): "the same loss
curve on every layout" means this curve — the dense model, the whole global batch each step,
a plain torch optimizer, dropout keyed by the global rows and positions (``minitrain.dropout``)
exactly as ``ParallelGPT`` keys it.
"""

from __future__ import annotations

import torch

from minitrain.data import get_batch
from minitrain.model import GPT, GPTConfig
from minitrain.parallel.parallelize import OPTIMIZERS


def single_process_losses(config: GPTConfig, steps: int, batch_size: int, lr: float,
                          seed: int, first_step: int = 0, optimizer: str = "adamw",
                          data=None) -> list[float]:
    """The reference: the dense GPT, AdamW (or ``optimizer``), the whole global batch, one
    process; ``data`` as ``ParallelGPT``'s (default: the synthetic chain)."""
    torch.manual_seed(seed)
    model = GPT(config)
    keys = model.dropout_keys  # keyed dropout, as ParallelGPT's: the same masks (model.py)
    opt = OPTIMIZERS[optimizer](model.parameters(), lr=lr)
    losses = []
    for step in range(first_step, first_step + steps):
        if data is not None:
            x, y = data.get_batch(step, batch_size)
        else:
            x, y = get_batch(step, batch_size, vocab_size=config.vocab_size,
                             seq_len=config.seq_len, seed=seed)
        opt.zero_grad(set_to_none=True)
        keys.current = keys.key(seed, step, torch.arange(batch_size, device=x.device),
                                torch.arange(x.shape[1], device=x.device))
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
