"""Between DCP checkpoints and single ``torch.save`` files.

``dcp_to_torch_save`` allocates every saved tensor at its full shape from the
metadata, loads the checkpoint into them (re-assembling the chunks of sharded
tensors) and rebuilds the original nesting from the planner's key paths.
``torch_save_to_dcp`` is a one-process ``save`` of the loaded file.

``BroadcastingTorchSaveReader`` + ``DynamicMetaLoadPlanner`` load a ``torch.save``
file straight into a sharded state_dict, on every rank: the planner makes the
metadata from the state_dict being loaded (each rank's chunks, as if saved as
they are held), and the reader reads the file on the coordinator alone and
broadcasts it one tensor at a time; each rank keeps the box it holds.

    plan step   every rank: metadata from its own state_dict -> read items (one per held chunk)
                coordinator: torch.load the file; check every rank's items against it (keys, shapes,
                tensors only); give every rank the same list of (key, shape, dtype) to broadcast
    read step   for each key of the list: the coordinator broadcasts the file's tensor, every rank
                copies the boxes it holds out of it
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from typing import Any

import torch
from torch.futures import Future

from .._c10d.collectives import broadcast
from .._c10d.init import get_rank
from ._chunks import narrow, tensor_view
from ._traverse import flatten_state_dict, set_element
from .default_planner import DefaultLoadPlanner
from .metadata import ChunkStorageMetadata, Metadata, STORAGE_TYPES, TensorProperties, TensorStorageMetadata
from .planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from .state_dict_loader import _load_state_dict
from .state_dict_saver import _save_state_dict
from .filesystem import FileSystemReader, FileSystemWriter
from .storage import StorageReader

__all__ = ["dcp_to_torch_save", "torch_save_to_dcp", "BroadcastingTorchSaveReader", "DynamicMetaLoadPlanner"]


class _EmptyStateDictLoadPlanner(DefaultLoadPlanner):
    """Loads everything the checkpoint holds, into full tensors it allocates from the metadata."""

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        if state_dict:
            raise ValueError("dcp_to_torch_save: the planner fills an empty state_dict; got one with keys "
                             f"{sorted(state_dict)[:5]}")
        paths = metadata.planner_data or {}
        for key, md in metadata.state_dict_metadata.items():
            # a placeholder for non-tensors, replaced by load_bytes; a full-size tensor for tensors
            value = (torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata)
                     else None)
            set_element(state_dict, paths.get(key, (key,)), value)
        super().set_up_planner(state_dict, metadata, is_coordinator)


def dcp_to_torch_save(dcp_checkpoint_dir: str | os.PathLike, torch_save_path: str | os.PathLike) -> None:
    """Write the DCP checkpoint in ``dcp_checkpoint_dir`` as one ``torch.save`` file (nesting restored)."""
    state_dict: dict[str, Any] = {}
    _load_state_dict(state_dict, FileSystemReader(dcp_checkpoint_dir), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    torch.save(state_dict, torch_save_path)


def torch_save_to_dcp(torch_save_path: str | os.PathLike, dcp_checkpoint_dir: str | os.PathLike) -> None:
    """Write the ``torch.save`` file ``torch_save_path`` as a DCP checkpoint in ``dcp_checkpoint_dir``."""
    state_dict = torch.load(torch_save_path, weights_only=False)
    _save_state_dict(state_dict, FileSystemWriter(dcp_checkpoint_dir), no_dist=True)


def _tensors_only_error(key: str, who: str) -> RuntimeError:
    return RuntimeError(f"Non-tensor value identified at {key}. At this time {who} only supports loading Tensors.")


class BroadcastingTorchSaveReader(StorageReader):
    """Reads a ``torch.save`` file on the coordinator rank and broadcasts each tensor; use it with
    ``DynamicMetaLoadPlanner`` (the file has no DCP metadata). Tensors only.

    ``dcp.load(sd, storage_reader=BroadcastingTorchSaveReader(), planner=DynamicMetaLoadPlanner(),
    checkpoint_id="model.pt")`` fills ``sd``'s tensors and DTensors (any placements) on every rank; only the
    coordinator reads the file and holds it in memory. Broadcasts go over the default process group.
    """

    def __init__(self, checkpoint_id: str | os.PathLike | None = None, coordinator_rank: int = 0) -> None:
        self.checkpoint_id = checkpoint_id
        self.coordinator_rank = coordinator_rank
        self.is_coordinator = False
        self._loaded: dict[str, Any] | None = None  # the file, flattened (coordinator only, during a load)

    def read_metadata(self) -> Metadata:
        """An empty Metadata: the planner builds it from the state_dict (the file has none)."""
        return Metadata(state_dict_metadata={})

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool) -> None:
        """Check that the load's coordinator is this reader's, and that there is a file to read."""
        self.is_coordinator = is_coordinator
        if is_coordinator and get_rank() != self.coordinator_rank:
            raise AssertionError(f"Coordinator rank mismatch: expected {self.coordinator_rank}, got {get_rank()}")
        if self.checkpoint_id is None:
            raise AssertionError("checkpoint_id must be set before setting up storage reader")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        """On the coordinator: read the file, check every rank's items against it, and give every rank the
        same broadcast schedule (checked here, so that no rank fails later while the others wait in a broadcast).
        """
        loaded, _ = flatten_state_dict(torch.load(self.checkpoint_id, map_location="cpu", weights_only=False))
        schedule = _broadcast_schedule(loaded, [item for plan in global_plan for item in plan.items],
                                       type(self).__name__)
        self._loaded = loaded  # for read_data, which runs next on this rank
        return [dataclasses.replace(plan, storage_data=schedule) for plan in global_plan]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Broadcast each scheduled tensor from the coordinator; copy into this rank's chunks what they hold."""
        if plan.storage_data is None:
            raise AssertionError("BroadcastingTorchSaveReader: the plan has no broadcast schedule; "
                                 "prepare_global_plan must run on the coordinator first")
        requests: dict[str, list[ReadItem]] = defaultdict(list)
        for item in plan.items:
            requests[item.storage_index.fqn].append(item)
        try:
            for fqn, shape, dtype in plan.storage_data:
                tensor = (self._loaded[fqn].detach().contiguous() if self.is_coordinator
                          else torch.empty(shape, dtype=dtype))
                broadcast(tensor, src=self.coordinator_rank)
                for request in requests.get(fqn, ()):
                    _copy_box(tensor, request, planner)
        finally:
            self._loaded = None  # the file is held for one load only
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.checkpoint_id = checkpoint_id

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """A ``torch.save`` checkpoint is a file."""
        return os.path.isfile(checkpoint_id)


def _broadcast_schedule(loaded: dict[str, Any], items: list[ReadItem], reader: str) -> list[tuple]:
    """``[(key, shape, dtype)]`` to broadcast, in the order the ranks ask for them; raises if the items and
    the file disagree: a key the file lacks, a non-tensor, or boxes that do not span the file's tensor.
    """
    extents: dict[str, list[int]] = {}
    for item in items:
        fqn = item.storage_index.fqn
        if item.type == LoadItemType.BYTE_IO:
            raise _tensors_only_error(fqn, reader)
        if fqn not in loaded:
            raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
        saved = loaded[fqn]
        if not isinstance(saved, torch.Tensor):
            raise _tensors_only_error(fqn, reader)
        ends = [o + s + n for o, s, n in zip(item.storage_index.offset, item.storage_offsets, item.lengths)]
        if len(ends) != saved.dim():
            raise ValueError(f"Size mismatch between saved {saved.shape} and current: a {len(ends)}-dim tensor "
                             f"for {fqn}")
        previous = extents.setdefault(fqn, ends)
        extents[fqn] = [max(a, b) for a, b in zip(previous, ends)]
    for fqn, extent in extents.items():
        # the ranks' boxes together cover the tensor being loaded: their far corner is its shape
        if torch.Size(extent) != loaded[fqn].shape:
            raise ValueError(f"Size mismatch between saved {loaded[fqn].shape} and current: {torch.Size(extent)} "
                             f"for {fqn}")
    return [(fqn, loaded[fqn].shape, loaded[fqn].dtype) for fqn in extents]


def _copy_box(full: torch.Tensor, request: ReadItem, planner: LoadPlanner) -> None:
    """Copy the box ``request`` names out of the whole tensor ``full`` into the planner's destination."""
    # the planner's metadata says each chunk was "saved" where it is held, so the box lies at the chunk's
    # offsets plus the offsets within it (PyTorch narrows by the latter alone)
    starts = [o + s for o, s in zip(request.storage_index.offset, request.storage_offsets)]
    box = narrow(full, starts, request.lengths)
    target = planner.resolve_tensor(request).detach()
    if target.size() != box.size():
        raise AssertionError(f"req {request.storage_index} mismatch sizes, {target.size()} vs {box.size()}")
    target.copy_(box)
    planner.commit_tensor(request, target)


class DynamicMetaLoadPlanner(DefaultLoadPlanner):
    """A ``DefaultLoadPlanner`` whose metadata is made from the state_dict being loaded, for checkpoints
    that have none (``torch.save`` files, with ``BroadcastingTorchSaveReader``). Tensors only.
    """

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        """Set up as the default planner does, then describe each tensor as saved just as it is held here."""
        super().set_up_planner(state_dict, metadata, is_coordinator)
        described: dict[str, STORAGE_TYPES] = {}
        for key, value in self.state_dict.items():
            view = tensor_view(value)
            if view is None:
                raise _tensors_only_error(key, type(self).__name__)
            chunks = [ChunkStorageMetadata(chunk.offsets, chunk.tensor.shape) for chunk in view.chunks]
            described[key] = TensorStorageMetadata(TensorProperties(dtype=view.properties.dtype), view.size, chunks)
        self.metadata = Metadata(state_dict_metadata=described)
