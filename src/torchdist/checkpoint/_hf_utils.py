"""The HuggingFace safetensors layout that PyTorch's DCP writes: file names, header keys, dtype names, the index.

A safetensors file is an 8-byte little-endian header length, a JSON header
(``{fqn: {"dtype", "shape", "data_offsets"}, "__metadata__": {str: str}}``)
and the tensors' raw bytes. DCP keeps each chunk's place in the global tensor
in ``__metadata__["DCP_SHARDING_INFO"]`` (JSON ``{fqn: {"saved_offsets": [...]}}``),
next to ``"DCP_VERSION": "1.0"`` and ``"format": "pt"``. Files are named
``model-0000k-of-0000N.safetensors`` (``shard-0000r-model-...`` when every rank
saves its own shards), and ``model.safetensors.index.json`` maps each key to its
file. The names and keys here are PyTorch 2.13's, so that either library reads
the other's files and ``huggingface`` tools read both.

The ``safetensors`` library is optional: it is imported only when an HF
storage is used, through :func:`import_safetensors`.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import struct
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

INDEX_FILE = "model.safetensors.index.json"
SUFFIX = ".safetensors"
SHARDED_DIR_NAME = "sharded"  # where enable_consolidation puts the per-rank files

# keys of a safetensors header, and of DCP's entries in its "__metadata__"
EXTRA_METADATA_KEY = "__metadata__"
SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
SAVED_OFFSETS_KEY = "saved_offsets"
VERSION_KEY = "DCP_VERSION"
VERSION_VALUE = "1.0"  # str(HF_DCP_VERSION) in PyTorch
FORMAT_KEY = "format"
FORMAT_VALUE = "pt"
SHAPE_KEY = "shape"
DTYPE_KEY = "dtype"
DATA_OFFSETS_KEY = "data_offsets"

_HEADER_LENGTH_BYTES = 8

#: safetensors' dtype names (its Rust ``Dtype``), as ``safetensors.torch`` maps them.
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass
class _HFStorageInfo:
    """Where a saved chunk is: its file (relative to the checkpoint directory), shape and dtype."""

    relative_path: str
    shape: torch.Size
    dtype: torch.dtype


def import_safetensors(module: str = "safetensors") -> ModuleType:
    """``module`` of the optional ``safetensors`` library, or an ImportError that says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError("torchdist.checkpoint's HuggingFaceStorageWriter/HuggingFaceStorageReader need the "
                          "safetensors library, which is not installed: pip install safetensors "
                          "(or pip install 'torchdist[hf]')") from exc


def file_name(index: int, largest_index: int, shard_index: int | None = None) -> str:
    """``model-{index}-of-{largest_index}.safetensors``, prefixed ``shard-{shard_index}-`` if given (5 digits)."""
    name = f"model-{index:05d}-of-{largest_index:05d}{SUFFIX}"
    return name if shard_index is None else f"shard-{shard_index:05d}-{name}"


def dtype_of(name: str, where: str) -> torch.dtype:
    """The torch dtype of safetensors' dtype ``name`` (found in ``where``, for the message)."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"{where}: safetensors dtype {name!r} has no torch dtype here; known: "
                         f"{sorted(DTYPES)}") from None


def sharding_metadata(offsets: dict[str, torch.Size]) -> dict[str, str]:
    """The ``__metadata__`` DCP writes into a file whose chunks of key ``fqn`` start at ``offsets[fqn]``."""
    info = {fqn: {SAVED_OFFSETS_KEY: list(offset)} for fqn, offset in offsets.items()}
    return {SHARDING_INFO_KEY: json.dumps(info), VERSION_KEY: VERSION_VALUE, FORMAT_KEY: FORMAT_VALUE}


def saved_offsets(extra_metadata: dict[str, str] | None) -> dict[str, list[int]] | None:
    """Each key's ``saved_offsets`` from a file's ``__metadata__``, or None for a file DCP did not write."""
    if not extra_metadata or not extra_metadata.get(SHARDING_INFO_KEY):
        return None
    return {fqn: entry[SAVED_OFFSETS_KEY] for fqn, entry in json.loads(extra_metadata[SHARDING_INFO_KEY]).items()}


def read_header(path: str | os.PathLike) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header, and where its data section starts (header length included)."""
    with open(path, "rb") as stream:
        raw = stream.read(_HEADER_LENGTH_BYTES)
        if len(raw) != _HEADER_LENGTH_BYTES:
            raise ValueError(f"{path} is not a safetensors file: it is {len(raw)} bytes long")
        (length,) = struct.unpack("<Q", raw)
        header = stream.read(length)
    if len(header) != length:
        raise ValueError(f"{path} is truncated: its safetensors header should be {length} bytes, is {len(header)}")
    return json.loads(header), _HEADER_LENGTH_BYTES + length


def encode_header(entries: dict[str, dict[str, Any]]) -> bytes:
    """Header length + JSON, written as PyTorch's consolidation writes it (``json.dumps`` defaults, no padding)."""
    data = json.dumps(entries).encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def nbytes(shape: list[int] | torch.Size, dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def write_index(directory: str | os.PathLike, weight_map: dict[str, str], total_size: int) -> None:
    """``model.safetensors.index.json``: which file holds each key, and the bytes of all tensors."""
    with open(os.path.join(directory, INDEX_FILE), "w") as stream:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, stream, indent=2)
