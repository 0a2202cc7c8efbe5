"""How a module's parameters become this rank's shards: which stay whole, and the registering.

Chapter 5, notebooks/05_zero.ipynb; called once by ``FullyShardedDataParallel.__init__``.
FSDP's interface (Zhao et al. 2023, "Flat Parameters") is that the wrapped module's
``parameters()`` *are* the flat shards, so an ordinary optimizer steps exactly what this rank
owns: each unit's shard is registered as an ``nn.Parameter`` of the unit's module, and the
original parameters stay on their modules as plain attributes — the same tensors, views of the
gathered buffer — so the forward reads them as before. ``replicated_params`` (kept whole,
gradients all-reduced as DDP) are checked here to be the module's own trainable parameters.
"""

from __future__ import annotations

import torch


def replicated_ids(named: list, replicated) -> set:
    """Ids of ``replicated_params``, each checked to be a trainable parameter of the module
    (``named``: its trainable (name, parameter) pairs)."""
    if replicated is None:
        return set()
    if isinstance(replicated, torch.Tensor):
        raise ValueError("FullyShardedDataParallel: replicated_params must be a list of tensors")
    names = {id(p): n for n, p in named}
    for i, p in enumerate(replicated):
        if not isinstance(p, torch.Tensor) or id(p) not in names:
            what = f"a tensor of shape {tuple(p.shape)}" if isinstance(p, torch.Tensor) else repr(p)
            raise ValueError(
                f"FullyShardedDataParallel: replicated_params[{i}] ({what}) is not a trainable "
                "parameter of the module"
            )
    return {id(p) for p in replicated}


def register_shards(fsdp) -> None:
    """The shards of ``fsdp`` (a ``FullyShardedDataParallel`` whose units are built) become
    its module's parameters — each block's unit on the block as ``flat_shard``, the root's on
    the module, the replicated unit's as ``flat_replicated`` — and the originals plain
    attributes (the same tensors, views of ``u.full``), so ``parameters()`` lists what the
    optimizer steps. An attribute of that name already there is an error naming it."""
    owners = list(zip(fsdp.blocks, fsdp.units[:-1], ["flat_shard"] * len(fsdp.blocks)))
    owners += [(fsdp.module, fsdp.root, "flat_shard")]
    owners += [(fsdp.module, fsdp.replicated, "flat_replicated")]
    for owner, u, attr in owners:
        if u is None:
            continue
        if hasattr(owner, attr):
            raise ValueError(
                f"FullyShardedDataParallel: {type(owner).__name__} already has an "
                f"attribute {attr!r}, where the unit {u.name!r} keeps its shard"
            )
        owner.register_parameter(attr, u.master)
    hidden = {id(p) for u in fsdp.live_units() for p in u.params}
    for m in fsdp.module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and id(p) in hidden:
                del m._parameters[name]
                m.__dict__[name] = p  # the forward reads it exactly as before
