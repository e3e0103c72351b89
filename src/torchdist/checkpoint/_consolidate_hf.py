"""Consolidation: per-rank safetensors chunk files in, one full tensor per key out, HuggingFace's layout.

With ``save_distributed=True`` each rank writes the chunks it holds into its
own ``shard-0000r-model-...`` files; ``DCP_SHARDING_INFO`` in each file's
header says where each chunk starts. The coordinator then (in ``finish``)
assembles every key's full tensor from its chunks and writes the
``model-0000k-of-0000N`` files that ``fqn_to_index_mapping`` asks for, and
``model.safetensors.index.json``: a checkpoint that plain ``safetensors`` and
``transformers`` load. Byte for byte the output is PyTorch's (the same header,
written with ``json.dumps`` defaults and without padding, then the tensors in
mapping order).

Only headers are parsed here (no ``safetensors`` import needed); a tensor is
assembled in memory, one at a time per output file, with torch copies of the
chunks' boxes. Output files are written on ``num_threads`` threads.
"""

from __future__ import annotations

import glob
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ._chunks import narrow
from .filesystem import _map_files
from ._hf_utils import (DATA_OFFSETS_KEY, DTYPE_KEY, EXTRA_METADATA_KEY, SHAPE_KEY, SUFFIX, dtype_of, encode_header,
                        file_name, nbytes, read_header, saved_offsets, write_index)

__all__ = ["consolidate_safetensors_files"]

logger = logging.getLogger(__name__)


@dataclass
class _Chunk:
    """One saved chunk of a key: its file, the byte range of its data there, its offsets and shape."""

    path: str
    start: int  # absolute, in the file
    end: int
    offsets: list[int]
    shape: list[int]


@dataclass
class _Key:
    """A key's full tensor, as its chunks describe it."""

    dtype_name: str
    shape: list[int]
    chunks: list[_Chunk] = field(default_factory=list)


def _scan(input_dir: str) -> dict[str, _Key]:
    """Every key of the chunk files in ``input_dir``, with its chunks and the full shape they span."""
    keys: dict[str, _Key] = {}
    for path in sorted(glob.glob(os.path.join(input_dir, f"*{SUFFIX}"))):
        header, data_start = read_header(path)
        offsets = saved_offsets(header.get(EXTRA_METADATA_KEY))
        if offsets is None:
            raise ValueError(f"consolidation: {path} has no DCP_SHARDING_INFO in its safetensors metadata; only "
                             "files saved by HuggingFaceStorageWriter(save_distributed=True) can be consolidated")
        for fqn, entry in header.items():
            if fqn == EXTRA_METADATA_KEY:
                continue
            begin, end = entry[DATA_OFFSETS_KEY]
            chunk = _Chunk(path, data_start + begin, data_start + end, offsets[fqn], entry[SHAPE_KEY])
            key = keys.setdefault(fqn, _Key(entry[DTYPE_KEY], [0] * len(chunk.shape)))
            if key.dtype_name != entry[DTYPE_KEY] or len(key.shape) != len(chunk.shape):
                raise ValueError(f"consolidation: chunks of {fqn!r} disagree: {entry[DTYPE_KEY]} with "
                                 f"{len(chunk.shape)} dims in {path}, {key.dtype_name} with {len(key.shape)} elsewhere")
            key.shape = [max(full, o + n) for full, o, n in zip(key.shape, chunk.offsets, chunk.shape)]
            key.chunks.append(chunk)
    return keys


def _assemble(fqn: str, key: _Key) -> torch.Tensor:
    """The full tensor of ``fqn``: each chunk's bytes copied into its box; every element must be covered once."""
    dtype = dtype_of(key.dtype_name, f"consolidation of {fqn!r}")
    full = torch.empty(key.shape, dtype=dtype)
    covered = 0
    for chunk in key.chunks:
        numel = math.prod(chunk.shape)
        if numel == 0:
            continue
        with open(chunk.path, "rb") as stream:
            stream.seek(chunk.start)
            data = bytearray(stream.read(chunk.end - chunk.start))
        if len(data) != numel * full.element_size():
            raise ValueError(f"consolidation: {chunk.path} holds {len(data)} bytes for {fqn!r}, want "
                             f"{numel * full.element_size()} (shape {chunk.shape}, {dtype})")
        narrow(full, chunk.offsets, chunk.shape).copy_(torch.frombuffer(data, dtype=dtype).reshape(chunk.shape))
        covered += numel
    if covered != full.numel():
        raise ValueError(f"consolidation: the chunks of {fqn!r} cover {covered} of its {full.numel()} elements "
                         f"(full shape {key.shape}); the sharded checkpoint is incomplete")
    return full


def _write_file(path: str, fqns: list[str], keys: dict[str, _Key]) -> int:
    """One output file: its header, then each key's full tensor in order. Returns the bytes of its tensors."""
    entries: dict[str, dict[str, Any]] = {}
    offset = 0
    for fqn in fqns:
        key = keys[fqn]
        end = offset + nbytes(key.shape, dtype_of(key.dtype_name, fqn))
        entries[fqn] = {SHAPE_KEY: key.shape, DTYPE_KEY: key.dtype_name, DATA_OFFSETS_KEY: [offset, end]}
        offset = end
    with open(path, "wb") as stream:
        stream.write(encode_header(entries))
        for fqn in fqns:
            stream.write(_assemble(fqn, keys[fqn]).reshape(-1).view(torch.uint8).numpy().data)
    return offset


def consolidate_safetensors_files(input_dir: str, output_dir: str, fqn_to_index_mapping: dict[str, int],
                                  num_threads: int = 1) -> None:
    """Write the full tensors of the chunk files in ``input_dir`` into ``output_dir``, key ``fqn`` into file
    ``model-{fqn_to_index_mapping[fqn]}-of-{max index}``, and the index of them."""
    keys = _scan(input_dir)
    missing = sorted(set(fqn_to_index_mapping) - set(keys))
    if missing:
        raise ValueError(f"consolidation: keys {missing} of fqn_to_index_mapping are in no file of {input_dir}")
    largest = max(fqn_to_index_mapping.values())
    outputs: dict[str, list[str]] = {}
    for fqn, index in fqn_to_index_mapping.items():
        outputs.setdefault(file_name(index, largest), []).append(fqn)
    os.makedirs(output_dir, exist_ok=True)
    jobs = [(os.path.join(output_dir, name), fqns) for name, fqns in outputs.items()]
    sizes = _map_files(lambda job: _write_file(job[0], job[1], keys), jobs, num_threads, "dcp-consolidate")
    weight_map = {fqn: name for name, fqns in outputs.items() for fqn in fqns}
    write_index(output_dir, weight_map, sum(sizes))
    logger.info("consolidated %d keys from %s into %d files in %s", len(weight_map), input_dir, len(jobs), output_dir)
