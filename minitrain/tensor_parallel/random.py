"""Two random streams for dropout under tensor parallelism (Megatron-LM's RNG tracker idea).

Where ranks hold *replicas* (the residual stream without sequence parallelism), dropout
must drop the same elements on every rank, or the replicas drift apart: those regions use
the default generator, seeded alike on every rank. Where ranks hold *different* pieces
(their attention heads; with sequence parallelism, their shard of the sequence), the masks
must differ, or every shard would repeat one pattern: those regions run inside
``fork()``, on a per-rank stream seeded ``seed + 2718 + rank`` (Shoeybi et al. 2019 use
the same offset). Forking saves the default generator's state and restores it after, so
the shared stream is untouched by what ran inside.

The stream is state like the default generator's: activation checkpointing replays it in the
recompute (``get_state`` / ``set_state``, as Megatron-LM's CheckpointFunction does with its
CUDA RNG tracker), and a run checkpoint saves it (``rng_state_dict(model)``).

How it relates to keyed dropout (``minitrain.dropout``, chapter 11): these streams make
tensor parallelism *consistent* (replicas agree, shards differ) but not equal to one process —
a rank's heads draw from a stream one process never has. When the GPT's ``dropout_keys``
holds a key (``ParallelGPT`` sets one per micro-batch), every mask is a function of its
element's global coordinates instead (a rank's heads are addressed by their global index),
nothing is drawn from these streams, and the curve is one process's. Without a key (chapter 6,
notebook 06) dropout draws from them as described above.
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

    # ------------------------------------------------------------------ its state
    # Two uses, one representation: activation checkpointing (chapter 3) replays the stream
    # around a recompute (``get_state`` / ``set_state``, which also carry whether a fork is
    # open, as a recompute must see it); a run checkpoint saves it between steps
    # (``state_dict`` / ``load_state_dict``), or a resumed run would restart every
    # rank's dropout masks from the seed.
    def get_state(self) -> dict:
        """Where the stream is: a copy of each device's generator state and whether a fork is
        open (inside one, the stream's live position is the default generator's)."""
        return {"states": {k: v.clone() for k, v in self._states.items()},
                "inside": self._inside}

    def set_state(self, state: dict) -> None:
        """Put the stream back where ``get_state`` found it."""
        self._states = {k: v.clone() for k, v in state["states"].items()}
        self._inside = state["inside"]

    def state_dict(self) -> dict:
        """The stream for a run checkpoint (seed and per-device states), taken between steps."""
        if self._inside:
            raise RuntimeError("TensorParallelRNG.state_dict() inside fork(): the stream's "
                               "position is in the default generator; save between steps")
        return {"seed": self.seed, "states": self.get_state()["states"]}

    def load_state_dict(self, state: dict) -> None:
        """Continue the stream saved by ``state_dict``: the seed must be this rank's."""
        if state["seed"] != self.seed:
            raise ValueError(f"this per-rank dropout stream has seed {self.seed}, the saved one "
                             f"{state['seed']}: saved by another tensor-parallel rank or seed")
        self.set_state({"states": state["states"], "inside": False})


def rng_streams(model) -> dict[str, TensorParallelRNG]:
    """Every distinct per-rank stream held by ``model``'s modules, by the first attribute path
    holding it (``apply_tensor_parallel`` shares one: ``tp_rng`` on the model)."""
    found: dict[str, TensorParallelRNG] = {}
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, TensorParallelRNG) and all(value is not s for s in found.values()):
                found[f"{name}.{attr}" if name else attr] = value
    return found


def rng_state_dict(model) -> dict:
    """The states of ``model``'s per-rank dropout streams, for a run checkpoint."""
    return {path: stream.state_dict() for path, stream in rng_streams(model).items()}


def load_rng_state_dict(model, state: dict) -> None:
    """Continue ``model``'s per-rank dropout streams from ``rng_state_dict``'s output."""
    streams = rng_streams(model)
    if set(streams) != set(state):
        raise ValueError(f"the model's per-rank dropout streams {sorted(streams)} are not the "
                         f"checkpoint's {sorted(state)}")
    for path, stream in streams.items():
        stream.load_state_dict(state[path])
