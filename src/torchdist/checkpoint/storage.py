"""The storage interfaces: where a plan's items go (``StorageWriter``) and come from (``StorageReader``).

A writer sees ``reset -> set_up_storage_writer -> prepare_local_plan``
on every rank, ``prepare_global_plan`` on the coordinator, ``write_data`` on
every rank, and ``finish`` (write the metadata) on the coordinator. A reader sees
``reset -> read_metadata -> set_up_storage_reader -> prepare_local_plan``,
``prepare_global_plan`` on the coordinator, then ``read_data`` on every rank.
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from typing import Any

from torch.futures import Future

from .metadata import Metadata, MetadataIndex, StorageMeta
from .planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner

__all__ = ["WriteResult", "StorageWriter", "StorageReader"]


@dataclass(frozen=True)
class WriteResult:
    """Where one written item ended up (``storage_data`` is the writer's own record)."""

    index: MetadataIndex
    size_in_bytes: int
    storage_data: Any


class StorageWriter(abc.ABC):
    """Writes the items of a save plan, then the metadata (see the module docstring)."""

    @abc.abstractmethod
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Start a new save, to ``checkpoint_id`` if given."""

    @abc.abstractmethod
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Learn whether this rank is the coordinator (and its ``rank``, in kwargs)."""

    @abc.abstractmethod
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Adjust this rank's plan for the storage."""

    @abc.abstractmethod
    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator: adjust every rank's plan (e.g. give each rank its own file names)."""

    @abc.abstractmethod
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items; the future's value says where each went."""

    @abc.abstractmethod
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator: record every rank's results in the metadata and write it (the commit point)."""

    @classmethod
    @abc.abstractmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Whether this storage can handle ``checkpoint_id``."""

    def storage_meta(self) -> StorageMeta | None:
        return None


class StorageReader(abc.ABC):
    """Reads a checkpoint's metadata, then the items of a load plan (see the module docstring)."""

    @abc.abstractmethod
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Start a new load, from ``checkpoint_id`` if given."""

    @abc.abstractmethod
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata."""

    @abc.abstractmethod
    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Take the metadata (and learn whether this rank is the coordinator)."""

    @abc.abstractmethod
    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Adjust this rank's plan for the storage."""

    @abc.abstractmethod
    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """On the coordinator: adjust every rank's plan."""

    @abc.abstractmethod
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read this rank's items, handing each to the planner."""

    @classmethod
    @abc.abstractmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Whether this storage can handle ``checkpoint_id``."""
