"""Two random streams for dropout under tensor parallelism (Megatron-LM's RNG tracker idea).

Where ranks hold *replicas* (the residual stream without sequence parallelism), dropout
must drop the same elements on every rank, or the replicas drift apart: those regions use
the default generator, seeded alike on every rank. Where ranks hold *different* pieces
(their attention heads; with sequence parallelism, their shard of the sequence), the masks
must differ, or every shard would repeat one pattern: those regions run inside
``fork()``, on a per-rank stream seeded ``seed + 2718 + rank`` (Shoeybi et al. 2019 use
the same offset). Forking saves the default generator's state and restores it after, so
the shared stream is untouched by what ran inside.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


class TensorParallelRNG:
    """A per-rank random stream, entered with ``with rng.fork(device):``."""

    OFFSET = 2718

    def __init__(self, seed: int, rank: int):
        self.seed = seed + self.OFFSET + rank
        self._states: dict[str, torch.Tensor] = {}  # device -> the stream's saved state
        self._inside = False

    @staticmethod
    def _device_module(device: torch.device):
        # torch for the CPU generator, torch.cuda (or another accelerator's module) else
        return torch if device.type == "cpu" else torch.get_device_module(device.type)

    @contextmanager
    def fork(self, device="cpu"):
        """Run the block on this rank's own stream; re-entrant (an inner fork is a no-op)."""
        if self._inside:
            yield
            return
        device = torch.device(device)
        module = self._device_module(device)
        key = str(device)
        if key not in self._states:
            self._states[key] = torch.Generator(device).manual_seed(self.seed).get_state()
        shared = module.get_rng_state()
        module.set_rng_state(self._states[key])
        self._inside = True
        try:
            yield
        finally:
            self._inside = False
            self._states[key] = module.get_rng_state()
            module.set_rng_state(shared)
