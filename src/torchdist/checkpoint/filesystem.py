"""Checkpoints in a directory: ``__{rank}_{i}.distcp`` data files, one ``.metadata`` file. PyTorch's layout.

Each rank writes the items of its plan into its own files (one file, or one
per writer thread, or one per item with ``single_file_per_rank=False``):
non-tensor values as ``torch.save`` bytes, then tensor chunks, each one
``torch.save`` of the chunk, one after the other. Every item's (file, offset,
length) goes back to the coordinator, which records them in
``Metadata.storage_data`` and writes ``.metadata`` last, through a temporary
file and a rename: a checkpoint whose ``.metadata`` exists is complete.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.futures import Future

from ._chunks import narrow
from ._pickling import dump_metadata, load_metadata, register_torch_name
from .metadata import Metadata, MetadataIndex, StorageMeta
from .planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, WriteItem, WriteItemType
from .staging import BlockingAsyncStager
from .storage import StorageReader, StorageWriter, WriteResult

__all__ = ["FileSystemWriter", "FileSystemReader"]

_METADATA_FILE = ".metadata"
_SUFFIX = ".distcp"


@dataclass
class _StorageInfo:
    """Where one item's bytes are: a file of the checkpoint, an offset in it, a length."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: Sequence[str] | None = None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if v is not None}  # PyTorch leaves None fields out


@dataclass
class _StoragePrefix:
    """The file name prefix of one rank's data files."""

    prefix: str


register_torch_name(_StorageInfo, "filesystem")
register_torch_name(_StoragePrefix, "filesystem")


def _as_cpu_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor alone in a CPU storage of its own size: torch.save writes a view's whole storage otherwise."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if (not tensor.is_contiguous() or tensor.storage_offset() != 0
            or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()):
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def _completed(value: Any) -> Future:
    """A future already holding ``value``: the storages here do their I/O before returning one."""
    future: Future = Future()
    future.set_result(value)
    return future


def _map_files(work: Callable[[Any], Any], files: list, thread_count: int, thread_name: str) -> list:
    """``work(f)`` for every file ``f``, on up to ``thread_count`` threads when there are several."""
    if thread_count > 1 and len(files) > 1:
        with ThreadPoolExecutor(min(thread_count, len(files)), thread_name_prefix=thread_name) as pool:
            return list(pool.map(work, files))
    return [work(f) for f in files]


def _commit_read(planner: LoadPlanner, item: ReadItem, source: torch.Tensor, where: str = "") -> None:
    """Copy ``source`` (the box of a saved chunk that ``item`` asks for) into the planner's tensor."""
    target = planner.resolve_tensor(item).detach()
    if target.shape != source.shape:
        raise RuntimeError(f"checkpoint load: read item {item.storage_index}{where} has shape "
                           f"{tuple(source.shape)} but its destination has {tuple(target.shape)}")
    target.copy_(source)
    planner.commit_tensor(item, target)


def _split(items: list[WriteItem], buckets: int) -> list[list[WriteItem]]:
    """Items into per-file lists, PyTorch's way: non-tensors dealt round-robin, then each tensor (largest first)
    to the file with the fewest bytes so far; with one file, the plan's order. Files write non-tensors first."""
    if buckets == 1:
        return [items] if items else []
    out: list[list[WriteItem]] = [[] for _ in range(buckets)]
    load = [0] * buckets
    byte_items = [item for item in items if item.type == WriteItemType.BYTE_IO]
    for i, item in enumerate(byte_items):
        out[i % buckets].append(item)
    tensors = sorted((item for item in items if item.type != WriteItemType.BYTE_IO),
                     key=lambda item: item.tensor_storage_size(), reverse=True)
    for item in tensors:
        target = min(range(buckets), key=lambda b: load[b])
        out[target].append(item)
        load[target] += item.tensor_storage_size()
    return [bucket for bucket in out if bucket]


class FileSystemWriter(StorageWriter, BlockingAsyncStager):
    """Writes a checkpoint into the directory ``path`` (created if needed). As PyTorch's, it is also the stager
    ``async_save`` uses by default: a blocking copy to CPU (kept between saves with ``cache_staged_state_dict``)."""

    def __init__(self, path: str | os.PathLike, single_file_per_rank: bool = True, sync_files: bool = True,
                 thread_count: int = 1, per_thread_copy_ahead: int = 10_000_000, cache_staged_state_dict: bool = False,
                 overwrite: bool = True, _extensions: Sequence[Any] | None = None,
                 serialization_format: Any = None) -> None:
        if thread_count < 1:
            raise ValueError(f"FileSystemWriter: thread_count must be at least 1, got {thread_count}")
        if _extensions:
            raise NotImplementedError("FileSystemWriter: stream transform extensions are not supported by torchdist")
        self.path = Path(path)
        self.single_file_per_rank = single_file_per_rank
        self.sync_files = sync_files
        self.thread_count = thread_count
        self.per_thread_copy_ahead = per_thread_copy_ahead
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        self.overwrite = overwrite
        self.save_id = str(uuid.uuid4())
        self.is_coordinator = False
        self.rank: int | None = None

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.path.mkdir(parents=True, exist_ok=True)
        if not self.overwrite and (self.path / _METADATA_FILE).exists():
            raise RuntimeError(f"Checkpoint already exists and self.overwrite={self.overwrite}: {self.path} holds "
                               "a .metadata file; choose another checkpoint_id or pass overwrite=True")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{rank}_")) for rank, plan in
                enumerate(plans)]

    def _write_file(self, name: str, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        results = []
        ordered = [it for it in items if it.type == WriteItemType.BYTE_IO] + [
            it for it in items if it.type != WriteItemType.BYTE_IO]
        with open(self.path / name, "wb") as stream:
            for item in ordered:
                data = planner.resolve_data(item)
                offset = stream.tell()
                if item.type == WriteItemType.BYTE_IO:
                    stream.write(data.getbuffer())
                else:
                    torch.save(_as_cpu_contiguous(data), stream)
                length = stream.tell() - offset
                results.append(WriteResult(item.index, length, _StorageInfo(name, offset, length)))
            self._sync(stream)
        return results

    def _sync(self, stream) -> None:
        """With ``sync_files``, make ``stream``'s bytes durable before the file counts as written."""
        if self.sync_files:
            stream.flush()
            os.fsync(stream.fileno())

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data.prefix if plan.storage_data is not None else f"__{self.rank or 0}_"
        groups = _split(plan.items, self.thread_count) if self.single_file_per_rank else [[it] for it in plan.items]
        files = [(f"{prefix}{i}{_SUFFIX}", group) for i, group in enumerate(groups)]
        written = _map_files(lambda f: self._write_file(f[0], f[1], planner), files, self.thread_count, "dcp-writer")
        return _completed([result for results in written for result in results])

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {result.index: result.storage_data for rank in results for result in rank}
        metadata.storage_meta = self.storage_meta()
        name = _METADATA_FILE if self.use_collectives or self.rank is None else f"__{self.rank}{_METADATA_FILE}"
        partial = self.path / f"{name}.tmp"
        with open(partial, "wb") as stream:
            dump_metadata(metadata, stream)
            self._sync(stream)
        os.replace(partial, self.path / name)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


class FileSystemReader(StorageReader):
    """Reads a checkpoint from the directory ``path`` (written by torchdist or by torch.distributed.checkpoint)."""

    def __init__(self, path: str | os.PathLike, _extension_registry: Any = None) -> None:
        self.path = Path(path)
        self.load_id = str(uuid.uuid4())
        self.storage_data: dict[MetadataIndex, _StorageInfo] | None = None

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = None
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
        self.load_id = str(uuid.uuid4())

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = self.path / (_METADATA_FILE if rank is None else f"__{rank}{_METADATA_FILE}")
        try:
            with open(path, "rb") as stream:
                metadata = load_metadata(stream)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"checkpoint load: {path} does not exist; {self.path} is not a complete "
                                    "checkpoint (the coordinator writes .metadata last)") from exc
        except pickle.UnpicklingError as exc:
            raise RuntimeError(f"checkpoint load: cannot read {path}: {exc}") from exc
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise ValueError(f"checkpoint load: the metadata of {self.path} has no storage_data; it was not written "
                             "by a file system writer")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _slice(self, stream: io.BufferedReader, info: _StorageInfo) -> bytes:
        if info.transform_descriptors:
            raise NotImplementedError(f"checkpoint load: {info.relative_path} was written with stream transforms "
                                      f"{list(info.transform_descriptors)}, which torchdist does not support")
        stream.seek(info.offset)
        data = stream.read(info.length)
        if len(data) != info.length:
            raise RuntimeError(f"checkpoint load: {self.path / info.relative_path} is truncated: wanted "
                               f"{info.length} bytes at offset {info.offset}, got {len(data)}")
        return data

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            with open(self.path / relative_path, "rb") as stream:
                cached: tuple[int, torch.Tensor] | None = None  # the last chunk read: several items may use it
                for item in sorted(items, key=lambda it: self.storage_data[it.storage_index].offset):
                    info = self.storage_data[item.storage_index]
                    if item.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(item, io.BytesIO(self._slice(stream, info)))
                        continue
                    if cached is None or cached[0] != info.offset:
                        chunk = torch.load(io.BytesIO(self._slice(stream, info)), map_location="cpu",
                                           weights_only=True)
                        cached = (info.offset, chunk)
                    _commit_read(planner, item, narrow(cached[1], item.storage_offsets, item.lengths))
        return _completed(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))
