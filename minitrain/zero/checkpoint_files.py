"""The files of a sharded checkpoint: errors every rank agrees on, atomic writes, checksums.

Chapter 5 (``minitrain.zero.checkpoint``, notebooks/05_zero.ipynb) and chapter 11
(``minitrain.parallel.run_checkpoint``) write their checkpoints with these. Why each:

- ``agree_on_errors``: a rank that fails alone would leave the others waiting in the next
  collective; every rank learns every rank's error and all raise together.
- ``atomic_write``: a reader sees the old file or the new one, never half of one.
- ``serialized`` / ``load_verified`` (issue 30): a flipped byte inside a weight unpickles fine
  and trains on garbage; the SHA-256 recorded in meta.json at save time is the only witness.
- ``agree_on_errors_or_clean``: a save that failed anywhere (a full disk) removes its
  ``.partial`` directory instead of leaving ``.tmp`` files behind.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable or does not match; the message names the file."""


def agree_on_errors(error: str | None, group: ProcessGroup | None = None, what: str = "") -> None:
    """Every rank learns every rank's error: all raise together or none does (no hang).
    ``what`` (e.g. "saving a checkpoint") prefixes the message."""
    errors = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    found = list(dict.fromkeys(e for e in errors if e))
    if found:
        raise CheckpointError((f"{what}: " if what else "") + "; ".join(found))


def atomic_write(path: str, write) -> None:
    """``write(file)`` into ``path.tmp``, flushed to disk, then renamed onto ``path``."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)  # atomic: readers see the old file or the new one, never half


def serialized(obj) -> tuple[bytes, str]:
    """``torch.save(obj)``'s bytes and their SHA-256 (hex), to write and to record in meta.json."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def load_verified(path: str, sha256: str | None, what: str = "checkpoint file", check=None):
    """``torch.load(path, weights_only=True)`` after checking the bytes against ``sha256`` (the
    digest meta.json recorded; ``None``: a checkpoint from before checksums, not checked)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} is missing") from None
    try:  # weights_only: unpickling even a damaged file can only build tensors and plain data
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{what} {path} cannot be read (truncated or corrupt?): "
                              f"{type(exc).__name__}: {str(exc)[:150]}") from None
    if check is not None:  # "belongs to another checkpoint" says more than a checksum would
        check(payload)
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise CheckpointError(f"{what} {path} is corrupt: its SHA-256 differs from the one "
                              f"recorded in meta.json when it was written")
    return payload


def agree_on_errors_or_clean(error, partial: str, rank: int, group=None, what: str = "") -> None:
    """``agree_on_errors``; when a rank failed, rank 0 removes the ``.partial`` directory (the
    others have stopped writing: they are all here) before every rank raises."""
    try:
        agree_on_errors(error, group, what)
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise
