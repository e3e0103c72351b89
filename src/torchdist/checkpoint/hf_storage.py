"""Checkpoints as HuggingFace safetensors files: PyTorch's ``HuggingFaceStorageWriter`` / ``HuggingFaceStorageReader``.

Writer, by its arguments (file names and headers as in ``_hf_utils.py``):

================================  ==========================================================================
``save_distributed=False``        the (full) tensors go to ``model-0000k-of-0000N.safetensors`` by
                                  ``fqn_to_index_mapping`` (all in ``model-00001-of-00001`` without one),
                                  and ``model.safetensors.index.json`` maps each key to its file. Ranks
                                  must not write the same file: save from one rank, or map them apart.
``save_distributed=True``         each rank r writes the chunks it holds to ``shard-0000{r+1}-model-...``;
                                  no index (a key lies in several files).
``+ enable_consolidation=True``   the shard files go to ``path/sharded``, and the coordinator then writes
                                  full tensors and the index into ``path`` (``_consolidate_hf.py``).
================================  ==========================================================================

No ``.metadata`` file is written: the reader rebuilds the checkpoint's metadata
from the safetensors headers of the files in its directory (each chunk's place
from ``DCP_SHARDING_INFO``, offsets 0 for files DCP did not write, such as a
model downloaded from the Hub). Only tensors can be stored; a non-tensor value
is refused at planning time rather than written as bytes that break the file.

Both classes build on the file system storage (the directory, the save/load
ids, ``set_up_storage_reader``) and change only where bytes go.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch
from torch.futures import Future

from ._consolidate_hf import consolidate_safetensors_files
from ._hf_utils import (INDEX_FILE, SHARDED_DIR_NAME, SUFFIX, _HFStorageInfo, dtype_of, file_name, import_safetensors,
                        sharding_metadata, saved_offsets, write_index)
from .filesystem import (FileSystemReader, FileSystemWriter, _as_cpu_contiguous, _commit_read, _completed,
                         _map_files, _StorageInfo)
from .metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties,
                       TensorStorageMetadata)
from .planner import LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, WriteItem, WriteItemType
from .storage import WriteResult

__all__ = ["HuggingFaceStorageWriter", "HuggingFaceStorageReader"]

logger = logging.getLogger(__name__)


class HuggingFaceStorageWriter(FileSystemWriter):
    """Writes a checkpoint as safetensors files into the directory ``path`` (see the module docstring).

    ``fqn_to_index_mapping`` sends key ``fqn`` to file ``model-{index}-of-{max index}`` (indices from 1);
    ``thread_count`` files are written at once; ``thread_count_consolidation`` output files are consolidated
    at once.
    """

    def __init__(self, path: str | os.PathLike, fqn_to_index_mapping: dict[str, int] | None = None,
                 thread_count: int = 1, save_distributed: bool = False, enable_consolidation: bool = False,
                 thread_count_consolidation: int = 1) -> None:
        import_safetensors()  # fail now, not in the middle of a save
        super().__init__(path=path, thread_count=thread_count)
        if fqn_to_index_mapping is not None and any(index < 1 for index in fqn_to_index_mapping.values()):
            raise ValueError(f"HuggingFaceStorageWriter: fqn_to_index_mapping indices start at 1, got "
                             f"{ {k: v for k, v in fqn_to_index_mapping.items() if v < 1} }")
        self.fqn_to_index_mapping = fqn_to_index_mapping
        self.save_distributed = save_distributed
        self.enable_consolidation = enable_consolidation
        self.thread_count_consolidation = thread_count_consolidation
        self.consolidated_output_path: str | None = None
        if enable_consolidation:
            self.consolidated_output_path = str(self.path)
            self.path = self.path / SHARDED_DIR_NAME

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id is not None and self.enable_consolidation:
            self.consolidated_output_path = str(self.path)
            self.path = self.path / SHARDED_DIR_NAME

    @property
    def metadata_path(self) -> str:
        return INDEX_FILE

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise ValueError(f"HuggingFaceStorageWriter stores tensors only, but the state_dict holds "
                                 f"{item.index.fqn!r}, which is not a tensor; leave it out or save it elsewhere")
            if self.fqn_to_index_mapping is not None and item.index.fqn not in self.fqn_to_index_mapping:
                raise ValueError(f"HuggingFaceStorageWriter: {item.index.fqn!r} is not in fqn_to_index_mapping "
                                 f"(which has {len(self.fqn_to_index_mapping)} keys); give every key a file index")
        self.path.mkdir(parents=True, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if not self.save_distributed:
            owner: dict[int, int] = {}  # file index -> the first rank that writes it
            for rank, plan in enumerate(plans):
                for index in self._split(plan.items):
                    if owner.setdefault(index, rank) != rank:
                        raise ValueError(f"HuggingFaceStorageWriter(save_distributed=False): ranks {owner[index]} "
                                         f"and {rank} would both write {self._file_name(index, None)}; pass "
                                         "save_distributed=True to save sharded state, or save from one rank")
        new_plans = []
        for shard_index, plan in enumerate(plans, start=1):
            storage_data: dict[str, Any] = {}
            if self.fqn_to_index_mapping is not None:
                storage_data["fqn_to_index_mapping"] = self.fqn_to_index_mapping
            if self.save_distributed:
                storage_data["shard_index"] = shard_index
            new_plans.append(dataclasses.replace(plan, storage_data=storage_data))
        return new_plans

    def _split(self, items: list[WriteItem]) -> dict[int, list[WriteItem]]:
        """The plan's items by file index, in plan order."""
        if self.fqn_to_index_mapping is None:
            return {1: items} if items else {}
        buckets: dict[int, list[WriteItem]] = {}
        for item in items:
            buckets.setdefault(self.fqn_to_index_mapping[item.index.fqn], []).append(item)
        return buckets

    def _file_name(self, index: int, shard_index: int | None) -> str:
        largest = max(self.fqn_to_index_mapping.values()) if self.fqn_to_index_mapping is not None else 1
        return file_name(index, largest, shard_index)

    def _write_file(self, name: str, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        """One safetensors file of ``items``' tensors, with each chunk's global offsets in its metadata."""
        save = import_safetensors("safetensors.torch").save
        tensors: dict[str, torch.Tensor] = {}
        offsets: dict[str, torch.Size] = {}
        results = []
        for item in items:
            fqn = item.index.fqn
            if fqn in tensors:  # one rank holds one chunk of a key; two would need two names in one file
                raise ValueError(f"HuggingFaceStorageWriter: two chunks of {fqn!r} would go to {name}")
            tensors[fqn] = _as_cpu_contiguous(planner.resolve_data(item))
            offsets[fqn] = item.tensor_data.chunk.offsets
            length = tensors[fqn].numel() * tensors[fqn].element_size()
            results.append(WriteResult(item.index, length, _StorageInfo(name, 0, length)))
        with open(self.path / name, "wb") as stream:
            stream.write(save(tensors, metadata=sharding_metadata(offsets)))
            self._sync(stream)
        return results

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        storage_data = plan.storage_data or {}
        shard_index = storage_data.get("shard_index")
        files = [(self._file_name(index, shard_index), items) for index, items in self._split(plan.items).items()]
        written = _map_files(lambda f: self._write_file(f[0], f[1], planner), files, self.thread_count,
                             "dcp-hf-writer")
        return _completed([result for results in written for result in results])

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self.save_distributed and not self.enable_consolidation:
            logger.info("HuggingFaceStorageWriter: sharded checkpoint in %s, not consolidated", self.path)
            return
        if self.save_distributed:
            mapping = (self.fqn_to_index_mapping if self.fqn_to_index_mapping is not None
                       else dict.fromkeys(metadata.state_dict_metadata, 1))
            consolidate_safetensors_files(str(self.path), self.consolidated_output_path, mapping,
                                          self.thread_count_consolidation)
            return
        weight_map = {result.index.fqn: result.storage_data.relative_path for rank in results for result in rank}
        total_size = sum(result.storage_data.length for rank in results for result in rank)
        write_index(self.path, weight_map, total_size)


class HuggingFaceStorageReader(FileSystemReader):
    """Reads the ``*.safetensors`` files of the directory ``path``, ``thread_count`` files at once."""

    def __init__(self, path: str | os.PathLike, thread_count: int = 1) -> None:
        import_safetensors()
        super().__init__(path=path)
        self.thread_count = thread_count

    def read_metadata(self) -> Metadata:
        """The checkpoint's metadata, from the headers: each key's chunks, dtype and the global size they span."""
        safe_open = import_safetensors().safe_open
        md: dict[str, TensorStorageMetadata] = {}
        storage_data: dict[MetadataIndex, _HFStorageInfo] = {}
        names = sorted(name for name in os.listdir(self.path) if name.endswith(SUFFIX))
        if not names:
            raise FileNotFoundError(f"checkpoint load: {self.path} holds no {SUFFIX} files")
        for name in names:
            with safe_open(str(self.path / name), framework="pt") as f:
                offsets_of = saved_offsets(f.metadata())
                for fqn in f.keys():
                    view = f.get_slice(fqn)
                    shape = torch.Size(view.get_shape())
                    dtype = dtype_of(view.get_dtype(), f"{self.path / name}[{fqn!r}]")
                    offsets = torch.Size(offsets_of[fqn] if offsets_of is not None else [0] * len(shape))
                    chunk = ChunkStorageMetadata(offsets=offsets, sizes=shape)
                    end = torch.Size(o + n for o, n in zip(offsets, shape))
                    entry = md.get(fqn)
                    if entry is None:
                        md[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), end, [chunk])
                    else:
                        if entry.properties.dtype != dtype:
                            raise ValueError(f"checkpoint load: chunks of {fqn!r} in {self.path} have dtypes "
                                             f"{entry.properties.dtype} and {dtype} ({name})")
                        entry.chunks.append(chunk)
                        entry.size = torch.Size(max(a, b) for a, b in zip(entry.size, end))
                    storage_data[MetadataIndex(fqn, offsets)] = _HFStorageInfo(name, shape, dtype)
        metadata = Metadata(state_dict_metadata=md, storage_data=storage_data)
        metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _read_file(self, name: str, items: list[ReadItem], planner: LoadPlanner) -> None:
        """Copy each item's box of its saved chunk from file ``name`` into the planner's tensor."""
        with import_safetensors().safe_open(str(self.path / name), framework="pt") as f:
            for item in items:
                boxes = tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))
                _commit_read(planner, item, f.get_slice(item.storage_index.fqn)[boxes], f" of {name}")

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        _map_files(lambda entry: self._read_file(entry[0], entry[1], planner), list(per_file.items()),
                   self.thread_count, "dcp-hf-reader")
        return _completed(None)
