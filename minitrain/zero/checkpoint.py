"""Sharded checkpoints for ZeroDataParallel and FSDP: every rank saves only the slice it owns.

Chapter 5, notebooks/05_zero.ipynb. With ZeRO no rank holds the whole model state, so no rank
can write a whole checkpoint: rank r writes ``shard_r.pt`` (its parameter and optimizer
slices plus the layout that says which elements they are), rank 0 writes ``meta.json``.
(DeepSpeed and PyTorch's distributed checkpoint work the same way.)

Safety, so a crash mid-save never costs the last good checkpoint:

- everything is written into ``step_N.partial/``; each file is written to a temporary name,
  flushed to disk and renamed (``os.replace`` is atomic); only when every rank succeeded does
  rank 0 rename the directory to ``step_N/``. A directory without ``.partial`` is complete.
- loading checks each shard (readable? same checkpoint id, rank and layout?) and every rank
  agrees on the verdict before touching anything, so a truncated or foreign shard is a
  ``CheckpointError`` naming the file on every rank (no hang), and the model is unchanged.
- ``torch.load(weights_only=True)``: a checkpoint can only contain tensors and plain data.
- every file's SHA-256 is in ``meta.json`` and checked before the file is unpickled: a flipped
  byte in a weight unpickles fine (and trains on garbage), so only the checksum can see it.
- a save that fails (disk full) removes its ``.partial`` directory: no ``.tmp`` files are left.

Same world size: each rank loads its own shard back, bit for bit. Another world size (or
stage): every rank reads all shards, rebuilds each full parameter and each per-element
optimizer state by name, and cuts its new slice ("resharding").
"""

from __future__ import annotations

import json
import os
import shutil
import uuid

import torch
import torch.distributed as dist

# the files' side (errors every rank agrees on, atomic writes, checksums): checkpoint_files.py
from minitrain.zero.checkpoint_files import (  # noqa: F401 — importable from here as before
    CheckpointError,
    agree_on_errors,
    agree_on_errors_or_clean,
    atomic_write,
    load_verified,
    serialized,
)

FORMAT = 1


def _layout(zdp) -> list[dict]:
    return [
        {
            "name": u.name,
            "names": u.names,
            "shapes": [list(shape) for shape in u.shapes],
            "numel": u.numel,
            "shard_numel": u.shard_numel,
        }
        for u in zdp.live_units()
    ]


def _optimizer_of(zdp, optimizer):
    opt = optimizer if optimizer is not None else getattr(zdp, "optimizer", None)
    if opt is None:
        raise ValueError(
            f"{type(zdp).__name__} has no optimizer of its own: pass the one that steps its "
            "parameters as optimizer="
        )
    return opt


def _positions(zdp, opt) -> list[int]:
    """Where each unit's master sits in ``opt``'s parameter list: checkpoints index optimizer
    state by *unit*, so an external optimizer (FSDP's) may list the shards in any order."""
    where = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    missing = [u.name for u in zdp.live_units() if id(u.master) not in where]
    if missing:
        raise ValueError(f"the optimizer does not step the shards of units {missing}")
    return [where[id(u.master)] for u in zdp.live_units()]


def _unit_state(zdp, opt) -> dict:
    """``opt.state_dict()`` with its state keyed by unit index (the saved form)."""
    sd, pos = opt.state_dict(), _positions(zdp, opt)
    unit_of = {i: k for k, i in enumerate(pos)}
    state = {k: sd["state"][i] for k, i in enumerate(pos) if i in sd["state"]}
    groups = [{**g, "params": [unit_of[i] for i in g["params"] if i in unit_of]}
              for g in sd["param_groups"]]  # fmt: skip
    return {"state": state, "param_groups": groups}


def _load_unit_state(zdp, opt, saved: dict) -> None:
    """Load a state keyed by unit index into ``opt`` (its own parameter order)."""
    pos, current = _positions(zdp, opt), opt.state_dict()["param_groups"]
    if len(current) != len(saved["param_groups"]):
        raise CheckpointError(
            f"the optimizer has {len(current)} parameter groups, the checkpoint "
            f"{len(saved['param_groups'])}"
        )
    groups = [{**g, "params": c["params"]} for g, c in zip(saved["param_groups"], current)]
    state = {pos[int(k)]: v for k, v in saved["state"].items()}
    opt.load_state_dict({"state": state, "param_groups": groups})


def latest_checkpoint(directory: str) -> str | None:
    """The newest complete checkpoint (``step_N`` with its meta.json) in ``directory``."""
    if not os.path.isdir(directory):
        return None
    done = sorted(
        d
        for d in os.listdir(directory)
        if d.startswith("step_")
        and not d.endswith(".partial")
        and os.path.exists(os.path.join(directory, d, "meta.json"))
    )
    return os.path.join(directory, done[-1]) if done else None


def save_checkpoint(
    zdp, directory: str, step: int, extra: dict | None = None, optimizer=None
) -> str:
    """Write ``directory/step_<step>/`` collectively (every rank calls it); return its path.

    ``zdp``: a ``ZeroDataParallel`` or a ``minitrain.fsdp.FullyShardedDataParallel``; the
    latter has no optimizer of its own: pass the one stepping its parameters (``optimizer=``).
    """
    opt = _optimizer_of(zdp, optimizer)
    group = zdp.group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    final = os.path.join(directory, f"step_{step:08d}")
    partial = final + ".partial"
    error = None
    if rank == 0:
        if os.path.exists(final):
            error = f"checkpoint {final} already exists (refusing to overwrite it)"
        else:
            shutil.rmtree(partial, ignore_errors=True)  # left by an earlier crash
            os.makedirs(partial)
    agree_on_errors(error, group)
    ident = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(
        ident, src=dist.get_global_rank(group, 0) if group else 0, group=group
    )
    meta = {
        "format": FORMAT,
        "id": ident[0],
        "step": step,
        "world_size": world,
        "stage": zdp.stage,
        "units": _layout(zdp),
    }
    payload = {
        "meta": {**meta, "rank": rank},
        # the master is the authoritative copy (equal to the shard; on the host if offloaded)
        "shards": [u.master.detach().to("cpu", copy=True) for u in zdp.live_units()],
        "optimizer": _unit_state(zdp, opt),
        "extra": extra or {},
    }
    digest = None
    try:
        data, digest = serialized(payload)
        atomic_write(os.path.join(partial, f"shard_{rank:05d}.pt"), lambda fh: fh.write(data))
    except Exception as exc:  # e.g. disk full: every rank must hear about it
        error = f"rank {rank} could not write its shard in {partial}: {exc}"
    agree_on_errors_or_clean(error, partial, rank, group)
    digests = [None] * world
    dist.all_gather_object(digests, digest, group=group)
    if rank == 0:
        try:
            text = json.dumps({**meta, "files": [f"shard_{r:05d}.pt" for r in range(world)],
                               "sha256": digests})
            atomic_write(os.path.join(partial, "meta.json"), lambda fh: fh.write(text.encode()))
            os.replace(partial, final)  # the checkpoint appears whole, or not at all
        except Exception as exc:
            error = f"rank 0 could not complete checkpoint {final}: {exc}"
    agree_on_errors_or_clean(error, partial, rank, group)
    return final


def _read_shard(path: str, meta: dict, rank: int) -> dict:
    digests = meta.get("sha256")
    return load_verified(path, digests[rank] if digests else None, "checkpoint shard",
                         check=lambda payload: _check_shard(path, payload, meta, rank))


def _check_shard(path: str, payload, meta: dict, rank: int) -> None:
    mine = payload.get("meta", {}) if isinstance(payload, dict) else {}
    expected = {
        "id": meta["id"],
        "step": meta["step"],
        "rank": rank,
        "world_size": meta["world_size"],
        "units": meta["units"],
    }
    wrong = [k for k, v in expected.items() if mine.get(k) != v]
    if wrong:
        raise CheckpointError(
            f"checkpoint shard {path} does not belong to this checkpoint: its {wrong} differ from "
            f"meta.json (it says step {mine.get('step')}, rank {mine.get('rank')} of "
            f"{mine.get('world_size')}; expected step {meta['step']}, rank {rank} of "
            f"{meta['world_size']})"
        )


def load_checkpoint(zdp, path: str, optimizer=None) -> dict:
    """Load ``path`` into ``zdp`` (and ``optimizer``, FSDP's external one) collectively;
    reshards if the world size or layout differs.

    Returns the ``extra`` dict this rank saved (rank 0's when resharding). On any problem
    raises ``CheckpointError`` on every rank before changing anything.
    """
    opt = _optimizer_of(zdp, optimizer)
    group = zdp.group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    meta, payloads, error = None, {}, None
    meta_path = os.path.join(path, "meta.json")
    try:
        with open(meta_path) as fh:
            meta = json.load(fh)
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{meta_path}: format {meta.get('format')}, expected {FORMAT}")
        same = meta["world_size"] == world and meta["units"] == _layout(zdp)
        for r in [rank] if same else range(meta["world_size"]):
            payloads[r] = _read_shard(os.path.join(path, meta["files"][r]), meta, r)
        if not same:
            full = _unshard(meta, payloads)
            missing = [n for u in zdp.live_units() for n in u.names if n not in full["params"]]
            if missing:
                raise CheckpointError(f"checkpoint {path} has no parameters named {missing}")
    except CheckpointError as exc:
        error = f"rank {rank}: {exc}"
    except (OSError, ValueError, KeyError) as exc:
        error = f"rank {rank}: checkpoint metadata {meta_path} is missing or invalid: {exc}"
    agree_on_errors(error, group)
    with torch.no_grad():
        if same:
            for u, saved in zip(zdp.live_units(), payloads[rank]["shards"]):
                u.master.copy_(saved)
                u.shard.copy_(saved)
            _load_unit_state(zdp, opt, payloads[rank]["optimizer"])
        else:
            _reshard_into(zdp, opt, full, payloads[0]["optimizer"]["param_groups"])
        zdp.refresh_from_shards()
    return payloads[rank if same else 0]["extra"]


def _unshard(meta: dict, payloads: dict) -> dict:
    """Full parameters and per-element optimizer state by name, plus the scalar state."""
    params, state, scalars = {}, {}, {}
    ranks = range(meta["world_size"])
    for i, unit in enumerate(meta["units"]):
        flat = torch.cat([payloads[r]["shards"][i] for r in ranks])
        per_rank = [payloads[r]["optimizer"]["state"].get(i, {}) for r in ranks]
        flats = {
            k: torch.cat([s[k].reshape(-1) for s in per_rank])
            for k, v in per_rank[0].items()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        }
        scalars.update({k: v for k, v in per_rank[0].items() if k not in flats})
        offset = 0
        for name, shape in zip(unit["names"], unit["shapes"]):
            n = int(torch.Size(shape).numel())
            params[name] = flat[offset : offset + n].view(shape)
            state[name] = {k: f[offset : offset + n] for k, f in flats.items()}
            offset += n
    return {"params": params, "state": state, "scalars": scalars}


def _reshard_into(zdp, opt, full: dict, param_groups: list) -> None:
    state = {}
    for i, u in enumerate(zdp.live_units()):
        u.master.copy_(_my_slice(zdp, u, [full["params"][n] for n in u.names]))
        u.shard.copy_(u.master)
        keys = full["state"][u.names[0]].keys()
        if not keys:  # a unit no rank ever used: the optimizer has no state for it
            continue
        state[i] = {k: _my_slice(zdp, u, [full["state"][n][k] for n in u.names]) for k in keys}
        state[i].update(
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in full["scalars"].items()}
        )
    _load_unit_state(zdp, opt, {"state": state, "param_groups": param_groups})


def _my_slice(zdp, u, parts) -> torch.Tensor:
    """This rank's slice of unit ``u``'s padded flat buffer made of ``parts``."""
    flat = torch.cat([p.reshape(-1) for p in parts])
    flat = torch.nn.functional.pad(flat, (0, u.padded - u.numel))
    rank = 0 if u.keep_full else zdp.rank  # FSDP's replicated unit: every rank has it all
    return flat[rank * u.shard_numel : (rank + 1) * u.shard_numel]
