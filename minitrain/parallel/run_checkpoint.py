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
- loading checks the metadata (same model, same layout, the same learning-rate flags: the
  caller's identity keys named after flags, "--lr", are reported as flags) and each rank's
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
        for key, value in identity.items():
            if meta.get(key) != value:
                # a flag (identity keys named "--lr", …): resuming with the checkpoint's value
                # continues the run; another value would change it silently
                fix = f"resume with {key.split()[0]} {meta.get(key)}" if key.startswith("--") \
                    else "use the same layout"
                raise CheckpointError(
                    f"checkpoint {path} was written with {key} = {meta.get(key)}, but this run "
                    f"has {key} = {value} (start a new --checkpoint-dir, or {fix})")
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


def _check_file(file: str, payload, ident: str, rank: int) -> None:
    """A file of this checkpoint and this rank (checked before its checksum: says more)."""
    mine = payload.get("meta", {}) if isinstance(payload, dict) else {}
    if mine.get("id") != ident or mine.get("rank") != rank:
        raise CheckpointError(f"checkpoint file {file} belongs to another checkpoint "
                              f"(id {mine.get('id')}, rank {mine.get('rank')})")
