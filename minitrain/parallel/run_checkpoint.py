"""Sharded, atomic checkpoints of a training run on a device mesh (``python -m minitrain.train``).

Not activation checkpointing (chapter 3, ``minitrain.checkpointing``): these are the files a
run is saved to and resumed from.

Chapter 11, notebooks/11_putting_it_together.ipynb. Chapter 5's ``minitrain.zero.checkpoint``
saves the shards of *one* data-parallel group; on a mesh there is one such group per
(tensor, pipeline) coordinate, so here every global rank writes its own file and rank 0
the metadata, with the same safety rules (its ``latest_checkpoint`` and ``CheckpointError``
are reused):

- everything goes into ``step_N.partial/``, each file written to a temporary name, flushed
  and renamed; once every rank has written, rank 0 renames the directory to ``step_N/``.
  A crash or Ctrl-C at any moment leaves the previous ``step_M/`` whole;
- loading checks the metadata (same model, same layout, seed, learning-rate flags, data file
  and clipping: ``identity_mismatch`` names the flag that differs, with both values — the
  model's and the layout's keys as flags, "--d-model 64 in the checkpoint, 32 now") and each rank's
  file (readable, same id, the SHA-256 meta.json recorded for it), and every rank agrees on
  the verdict before anything changes: a corrupt file or a checkpoint of another layout is a
  ``CheckpointError`` naming it, on every rank, no hang;
- a save that fails on any rank (disk full) removes its ``.partial`` directory.

A rank's file holds what continuing *bit-exactly* needs: its parameter shards, its optimizer
state, the RNG state, and the step (the data position: batches are a function of the step).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid

import torch.distributed as dist

from minitrain.zero import CheckpointError, latest_checkpoint
from minitrain.zero.checkpoint import (
    agree_on_errors,
    agree_on_errors_or_clean,
    atomic_write,
    load_verified,
    serialized,
)

__all__ = ["CheckpointError", "latest_checkpoint", "load_run", "save_run"]


def save_run(directory: str, step: int, state: dict, identity: dict) -> str:
    """Collectively write ``directory/step_<step>/``; ``state``: this rank's tensors and data,
    ``identity``: what must match to load (model config, layout). Returns the path."""
    rank, world = dist.get_rank(), dist.get_world_size()
    final = os.path.join(directory, f"step_{step:08d}")
    partial = final + ".partial"
    error = None
    if rank == 0:
        try:
            if os.path.exists(final):
                shutil.rmtree(final)  # an older run's step N: this run's replaces it
            shutil.rmtree(partial, ignore_errors=True)  # left by an interrupted save
            os.makedirs(partial)
        except OSError as exc:
            error = f"cannot create {partial}: {exc}"
    agree_on_errors(error, what="saving a checkpoint")
    ident = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(ident, src=0)
    meta = {"id": ident[0], "step": step, "world_size": world, **identity}
    digest = None
    try:
        data, digest = serialized({"meta": {**meta, "rank": rank}, "state": state})
        atomic_write(os.path.join(partial, f"rank_{rank:05d}.pt"), lambda fh: fh.write(data))
    except Exception as exc:  # e.g. disk full: every rank must hear of it
        error = f"rank {rank} could not write its file in {partial}: {exc}"
    agree_on_errors_or_clean(error, partial, rank, what="saving a checkpoint")
    digests = [None] * world  # each file's SHA-256, checked on load (a flipped byte shows)
    dist.all_gather_object(digests, digest)
    if rank == 0:
        try:
            text = json.dumps({**meta, "sha256": digests}, indent=1)
            atomic_write(os.path.join(partial, "meta.json"), lambda fh: fh.write(text.encode()))
            os.replace(partial, final)  # the checkpoint appears whole, or not at all
        except Exception as exc:
            error = f"rank 0 could not complete checkpoint {final}: {exc}"
    agree_on_errors_or_clean(error, partial, rank, what="saving a checkpoint")
    return final


def load_run(path: str, identity: dict) -> tuple[int, dict]:
    """Collectively read ``path``; return (step, this rank's state). Raises CheckpointError on
    every rank if the checkpoint is unreadable, truncated, or from another model or layout."""
    rank, world = dist.get_rank(), dist.get_world_size()
    error, payload, meta = None, None, None
    meta_path = os.path.join(path, "meta.json")
    try:
        with open(meta_path) as fh:
            meta = json.load(fh)
        problem = identity_mismatch(meta, identity)
        if problem:
            raise CheckpointError(f"checkpoint {path} {problem}")
        if meta.get("world_size") != world:
            raise CheckpointError(f"checkpoint {path} has {meta.get('world_size')} ranks, "
                                  f"this run {world}")
        file = os.path.join(path, f"rank_{rank:05d}.pt")
        digests = meta.get("sha256")
        payload = load_verified(file, digests[rank] if digests else None,
                                check=lambda p: _check_file(file, p, meta["id"], rank))
    except CheckpointError as exc:
        error = f"rank {rank}: {exc}"
    except (OSError, ValueError, KeyError) as exc:
        error = f"rank {rank}: checkpoint metadata {meta_path} is missing or invalid: {exc}"
    agree_on_errors(error, what=f"cannot resume from {path}")
    return meta["step"], payload["state"]


# identity keys that are one flag but not named after it (kept: older checkpoints hold them)
FLAG_OF = {"seed": "--seed", "batch_size": "--batch-size"}
WHAT = {"config": "other model flags", "layout": "another layout"}
DERIVED = {"d_ff"}  # GPTConfig's 4 × d_model: named only if no flag differs


def identity_mismatch(meta: dict, identity: dict) -> str | None:
    """What differs between a checkpoint's metadata and this run's ``identity``, in one line
    naming every flag that differs with both values (None: nothing). Resuming with the
    checkpoint's values continues the run; another value would change it silently.
    ``identity``'s keys: flags ("--lr"), ``FLAG_OF``'s, or dicts of flags by their ``dest``
    ("config": ``d_model``, ...)."""
    problems, fixes = [], []
    for key, value in identity.items():
        saved = meta.get(key)
        if saved == value:
            continue
        if isinstance(value, dict) and isinstance(saved, dict):  # name each flag that differs
            keys = [k for k in {**saved, **value} if saved.get(k) != value.get(k)]
            keys = [k for k in keys if k not in DERIVED] or keys
            diffs = [f"--{k.replace('_', '-')} {_shown(saved.get(k))} in the checkpoint, "
                     f"{_shown(value.get(k))} now" for k in keys]
            problems.append(f"{WHAT.get(key, key)}: {'; '.join(diffs)}")
            fixes += [f"resume with --{k.replace('_', '-')} {_shown(saved.get(k))}" for k in keys]
            continue
        flag = FLAG_OF.get(key, key)
        problems.append(f"{flag} = {_shown(saved)}, but this run has {flag} = {_shown(value)}")
        fixes.append("resume on the --data file it was written with" if flag == "--data"
                      else f"resume with {flag.split()[0]} {_shown(saved)}")
    if not problems:
        return None
    fix = fixes[0] if len(fixes) == 1 and fixes[0].startswith("resume") \
        else "resume with the checkpoint's values"
    return f"was written with {'; '.join(problems)} (start a new --checkpoint-dir, or {fix})"


def _shown(value) -> str:
    """A flag's value as typed would read: a switch on/off, an unset flag none."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _check_file(file: str, payload, ident: str, rank: int) -> None:
    """A file of this checkpoint and this rank (checked before its checksum: says more)."""
    mine = payload.get("meta", {}) if isinstance(payload, dict) else {}
    if mine.get("id") != ident or mine.get("rank") != rank:
        raise CheckpointError(f"checkpoint file {file} belongs to another checkpoint "
                              f"(id {mine.get('id')}, rank {mine.get('rank')})")
