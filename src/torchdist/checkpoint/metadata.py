"""What a checkpoint's ``.metadata`` file holds: for each key, a tensor's global shape and chunks, or "bytes".

The classes have PyTorch's names, fields and pickled state, so that the file
can be read by ``torch.distributed.checkpoint`` and a file that PyTorch wrote can
be read here (see ``_pickling.py``).

Vocabulary: a *chunk* is a box of a global tensor, given by its ``offsets`` (the
global index of its first element) and its ``sizes``. A plain tensor is one
chunk at offset 0; a sharded tensor is saved as the chunks its ranks hold.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

__all__ = [
    "ChunkStorageMetadata", "TensorStorageMetadata", "BytesStorageMetadata", "Metadata", "MetadataIndex",
    "TensorProperties", "StorageMeta",
]


@dataclass
class ChunkStorageMetadata:
    """One saved box of a tensor: where it starts in the global tensor and how big it is."""

    offsets: torch.Size
    sizes: torch.Size


class _MEM_FORMAT_ENCODING(Enum):  # noqa: N801 - PyTorch's name, pickled in TensorProperties
    """How a memory format is pickled (torch.memory_format itself is not picklable)."""

    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


_FORMAT_TO_CODE = {
    torch.contiguous_format: _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT,
    torch.channels_last: _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST,
    torch.preserve_format: _MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT,
}
_CODE_TO_FORMAT = {code: fmt for fmt, code in _FORMAT_TO_CODE.items()}


@dataclass
class TensorProperties:
    """What is needed to allocate a tensor like the saved one."""

    dtype: torch.dtype = field(default_factory=torch.get_default_dtype)
    layout: torch.layout = field(default=torch.strided)
    requires_grad: bool = False
    memory_format: torch.memory_format = field(default=torch.contiguous_format)
    pin_memory: bool = False

    def __getstate__(self):
        if self.memory_format not in _FORMAT_TO_CODE:
            raise RuntimeError(f"Invalid torch.memory_format: {self.memory_format}")
        return (self.dtype, self.layout, self.requires_grad, _FORMAT_TO_CODE[self.memory_format], self.pin_memory)

    def __setstate__(self, state) -> None:
        self.dtype, self.layout, self.requires_grad, code, self.pin_memory = state
        if code not in _CODE_TO_FORMAT:
            raise RuntimeError(f"Invalid torch.memory_format encoding: {code}")
        self.memory_format = _CODE_TO_FORMAT[code]

    @staticmethod
    def create_from_tensor(tensor: torch.Tensor) -> TensorProperties:
        return TensorProperties(dtype=tensor.dtype, layout=tensor.layout, requires_grad=tensor.requires_grad,
                                memory_format=torch.contiguous_format, pin_memory=tensor.is_pinned())


@dataclass
class TensorStorageMetadata:
    """A saved tensor: its properties, global size, and the chunks that together cover it."""

    properties: TensorProperties
    size: torch.Size
    chunks: list[ChunkStorageMetadata]


@dataclass
class BytesStorageMetadata:
    """A saved non-tensor value (pickled with torch.save)."""


STORAGE_TYPES = TensorStorageMetadata | BytesStorageMetadata
STATE_DICT_TYPE = dict[str, Any]


@dataclass
class StorageMeta:
    """Which checkpoint, save and load this is (filled in by the storage layer)."""

    checkpoint_id: str | os.PathLike | None = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = field(default_factory=list)


@dataclass
class Metadata:
    """The whole checkpoint's table of contents, written once by the coordinator."""

    state_dict_metadata: dict[str, STORAGE_TYPES]
    planner_data: Any = None  # the default planners: flattened key -> its path in the nested state_dict
    storage_data: Any = None  # the file system storage: MetadataIndex -> where its bytes are
    storage_meta: StorageMeta | None = None
    version: str | None = None


@dataclass(frozen=True)
class MetadataIndex:
    """Names one saved item: a key, and for a tensor the offsets of its chunk. ``index`` is a search hint only."""

    fqn: str
    offset: torch.Size | None = None
    index: int | None = field(hash=False, compare=False, default=None)

    def __init__(self, fqn: str, offset: Sequence[int] | None = None, index: int | None = None):
        object.__setattr__(self, "fqn", fqn)
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "offset", None if offset is None else torch.Size(offset))
