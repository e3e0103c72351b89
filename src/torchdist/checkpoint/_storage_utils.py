"""Pick the storage for a ``checkpoint_id`` when the caller gave none, and decide whether to use collectives."""

from __future__ import annotations

import os
import warnings

from .._c10d.init import is_initialized
from .filesystem import FileSystemReader, FileSystemWriter
from .storage import StorageReader, StorageWriter


def storage_setup(storage: StorageReader | StorageWriter | None, checkpoint_id: str | os.PathLike | None,
                  reader: bool) -> StorageReader | StorageWriter:
    """``storage`` (re-pointed at ``checkpoint_id`` if given), or a file system one for ``checkpoint_id``."""
    if storage is not None:
        storage.reset(checkpoint_id)
        return storage
    if not checkpoint_id:
        raise RuntimeError("`checkpoint_id` must be specified if storage_reader/storage_writer is None.")
    target = FileSystemReader if reader else FileSystemWriter
    if not target.validate_checkpoint_id(checkpoint_id):
        raise RuntimeError("Cannot detect which StorageReader or StorageWriter to use. "
                           f"Please specify the storage_reader/storage_writer (checkpoint_id={checkpoint_id!r}).")
    storage = target(checkpoint_id)
    storage.reset(checkpoint_id)
    return storage


def resolve_no_dist(no_dist: bool, what: str) -> bool:
    """True when this save/load runs in this process alone (asked for, or no process group exists)."""
    no_dist = no_dist or not is_initialized()
    if no_dist:
        warnings.warn(f"torchdist is not initialized or no_dist=True, assuming the intent is to {what} in a single "
                      "process.", stacklevel=3)
    return no_dist
