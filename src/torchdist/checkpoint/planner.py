"""Plans: which items each rank writes or reads, and the planner interfaces that make them.

A save runs ``set_up_planner -> create_local_plan`` on every rank, then
``create_global_plan`` on the coordinator over all ranks' plans (deduplication,
metadata), then ``finish_plan`` on every rank with its part of the global plan;
the storage layer calls ``resolve_data`` for each item it writes. A load is the
same shape with ``ReadItem``s, and the storage layer hands the data back through
``load_bytes`` / ``resolve_tensor`` + ``commit_tensor``.
"""

from __future__ import annotations

import abc
import io
import operator
from dataclasses import dataclass
from enum import Enum, auto
from functools import reduce
from typing import Any

import torch

from .metadata import ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties

__all__ = [
    "WriteItemType", "LoadItemType", "BytesIOWriteData", "TensorWriteData", "WriteItem", "ReadItem", "SavePlan",
    "LoadPlan", "SavePlanner", "LoadPlanner",
]


class WriteItemType(Enum):
    TENSOR = auto()  # a whole plain tensor
    SHARD = auto()  # one chunk of a sharded tensor
    BYTE_IO = auto()  # a non-tensor value


class LoadItemType(Enum):
    TENSOR = auto()
    BYTE_IO = auto()


@dataclass(frozen=True)
class BytesIOWriteData:
    nbytes: int


@dataclass(frozen=True)
class TensorWriteData:
    """The chunk a write item carries, and the global tensor it belongs to."""

    chunk: ChunkStorageMetadata
    properties: TensorProperties
    size: torch.Size


@dataclass(frozen=True)
class WriteItem:
    """One item a rank writes: a chunk of a tensor, or a non-tensor value."""

    index: MetadataIndex
    type: WriteItemType
    bytes_io_data: BytesIOWriteData | None = None
    tensor_data: TensorWriteData | None = None

    def tensor_storage_size(self) -> int | None:
        """Bytes of the chunk's elements, or None for a non-tensor item."""
        if self.tensor_data is None:
            return None
        numel = reduce(operator.mul, self.tensor_data.chunk.sizes, 1)
        return numel * torch._utils._element_size(self.tensor_data.properties.dtype)


@dataclass(frozen=True)
class ReadItem:
    """Copy the box ``storage_offsets``+``lengths`` of a saved chunk to ``dest_offsets`` of a local chunk."""

    type: LoadItemType
    dest_index: MetadataIndex
    dest_offsets: torch.Size
    storage_index: MetadataIndex
    storage_offsets: torch.Size
    lengths: torch.Size


@dataclass(frozen=True)
class SavePlan:
    items: list[WriteItem]
    storage_data: Any = None
    planner_data: Any = None
    usable: bool = True


@dataclass
class LoadPlan:
    items: list[ReadItem]
    storage_data: Any = None
    planner_data: Any = None


class SavePlanner(abc.ABC):
    """Turns a state_dict into write items and the checkpoint's metadata (see the module docstring)."""

    @abc.abstractmethod
    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: StorageMeta | None = None,
                       is_coordinator: bool = False) -> None:
        """Take the state_dict this save writes."""

    @abc.abstractmethod
    def create_local_plan(self) -> SavePlan:
        """What this rank could write."""

    @abc.abstractmethod
    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """On the coordinator: the plans every rank will carry out, and the checkpoint's metadata."""

    @abc.abstractmethod
    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """Accept this rank's part of the global plan."""

    @abc.abstractmethod
    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        """The tensor (chunk) or bytes to write for ``write_item``."""


class LoadPlanner(abc.ABC):
    """Turns a state_dict to fill and a checkpoint's metadata into read items (see the module docstring)."""

    @abc.abstractmethod
    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        """Take the state_dict this load fills in place."""

    @abc.abstractmethod
    def create_local_plan(self) -> LoadPlan:
        """What this rank must read."""

    @abc.abstractmethod
    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        """On the coordinator: adjust every rank's plan."""

    @abc.abstractmethod
    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        """Accept this rank's part of the global plan."""

    @abc.abstractmethod
    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Store a non-tensor value read from storage."""

    def resolve_bytes(self, read_item: ReadItem) -> io.BytesIO:
        raise NotImplementedError("LoadPlanner.resolve_bytes is not implemented by this planner")

    @abc.abstractmethod
    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """The tensor (a view of the destination) that the storage layer copies ``read_item``'s data into."""

    @abc.abstractmethod
    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Called once the tensor from ``resolve_tensor`` holds the data."""
