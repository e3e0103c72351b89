"""The default planners: every held chunk is a write item, deduplicated; every held chunk reads what overlaps it.

Save: each rank proposes every value it holds (tensor chunks by key and
offsets, non-tensors by key). The coordinator keeps one copy of each item
(``_dedup.py``: replicated values are written once, spread over the ranks),
checks that each tensor's chunks agree on shape and dtype and tile it, and
builds the ``Metadata``. Load: for each local chunk, one read item per saved
chunk that overlaps it, so that the loading sharding is free.
"""

from __future__ import annotations

import dataclasses
import io
import operator
from functools import reduce
from typing import Any

import torch

from ._chunks import overlap, narrow, tensor_view
from ._dedup import dedup_save_plans
from ._traverse import FLATTEN_MAPPING, flatten_state_dict, set_element
from .metadata import (STORAGE_TYPES, BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
                       StorageMeta, TensorStorageMetadata)
from .planner import (LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, TensorWriteData,
                      WriteItem, WriteItemType)

__all__ = ["DefaultSavePlanner", "DefaultLoadPlanner", "create_default_local_save_plan",
           "create_default_global_save_plan", "create_default_local_load_plan"]

_DCP_VERSION = "1.0.0"  # the metadata version PyTorch 2.13 writes


def _write_items(fqn: str, value: Any) -> list[WriteItem]:
    view = tensor_view(value)
    if view is None:
        return [WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)]
    global_numel = reduce(operator.mul, view.size, 1)
    items = []
    for chunk in view.chunks:
        if chunk.tensor.numel() == 0 and global_numel > 0:
            continue  # an empty shard (e.g. a short last shard) holds nothing to write
        items.append(WriteItem(
            index=MetadataIndex(fqn, chunk.offsets),
            type=WriteItemType.SHARD if view.sharded else WriteItemType.TENSOR,
            tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(chunk.offsets, chunk.tensor.shape),
                                        properties=view.properties, size=view.size)))
    return items


def create_default_local_save_plan(state_dict: dict[str, Any], is_coordinator: bool) -> SavePlan:
    """Every item this rank holds; the coordinator drops the duplicates."""
    return SavePlan([item for fqn, value in state_dict.items() for item in _write_items(fqn, value)])


def _check_tiling(fqn: str, md: TensorStorageMetadata) -> None:
    """The chunks of a tensor lie inside it, do not overlap, and cover it."""
    covered = 0
    for i, chunk in enumerate(md.chunks):
        if len(chunk.offsets) != len(md.size) or any(
                o < 0 or o + n > s for o, n, s in zip(chunk.offsets, chunk.sizes, md.size)):
            raise ValueError(f"checkpoint save: a chunk of {fqn!r} at offsets {tuple(chunk.offsets)} with sizes "
                             f"{tuple(chunk.sizes)} lies outside its global shape {tuple(md.size)}")
        for other in md.chunks[:i]:
            if overlap(chunk.offsets, chunk.sizes, other.offsets, other.sizes) is not None:
                raise ValueError(f"checkpoint save: two chunks of {fqn!r} overlap (offsets {tuple(other.offsets)} "
                                 f"and {tuple(chunk.offsets)}); each element must be held by one chunk")
        covered += reduce(operator.mul, chunk.sizes, 1)
    numel = reduce(operator.mul, md.size, 1)
    if covered != numel and numel > 0:
        raise ValueError(f"checkpoint save: the chunks of {fqn!r} cover {covered} of its {numel} elements "
                         f"(global shape {tuple(md.size)}); some part of the tensor is held by no rank")


def create_default_global_save_plan(all_plans: list[SavePlan],
                                    rewrite_index_hints: bool = True) -> tuple[list[SavePlan], Metadata]:
    """The metadata of all ranks' (deduplicated) items; index hints set to each chunk's position."""
    md: dict[str, STORAGE_TYPES] = {}
    new_plans = []
    for rank, plan in enumerate(all_plans):
        new_items = []
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                if fqn in md:
                    raise ValueError(f"checkpoint save: key {fqn!r} is written twice (rank {rank} again)")
                md[fqn] = BytesStorageMetadata()
                new_items.append(item)
                continue
            data = item.tensor_data
            entry = md.setdefault(fqn, TensorStorageMetadata(data.properties, data.size, []))
            if not isinstance(entry, TensorStorageMetadata) or entry.size != data.size or (
                    entry.properties.dtype != data.properties.dtype):
                described = (f"shape {tuple(entry.size)}, {entry.properties.dtype}"
                             if isinstance(entry, TensorStorageMetadata) else "a non-tensor")
                raise ValueError(f"checkpoint save: ranks disagree about {fqn!r}: rank {rank} holds a tensor of "
                                 f"shape {tuple(data.size)}, {data.properties.dtype}, another rank {described}")
            if rewrite_index_hints:
                item = dataclasses.replace(item, index=dataclasses.replace(item.index, index=len(entry.chunks)))
            entry.chunks.append(data.chunk)
            new_items.append(item)
        new_plans.append(dataclasses.replace(plan, items=new_items))
    for fqn, entry in md.items():
        if isinstance(entry, TensorStorageMetadata):
            _check_tiling(fqn, entry)
    return new_plans, Metadata(state_dict_metadata=md)


def _check_replicas_agree(all_plans: list[SavePlan]) -> None:
    """Ranks that hold the same chunk of a tensor must agree on its shapes and dtype: dedup keeps one copy."""
    seen: dict[MetadataIndex, tuple[int, tuple]] = {}
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            if item.tensor_data is None:
                continue
            data = item.tensor_data
            described = (tuple(data.size), tuple(data.chunk.sizes), data.properties.dtype)
            first = seen.setdefault(item.index, (rank, described))
            if first[1] != described:
                raise ValueError(f"checkpoint save: ranks {first[0]} and {rank} both hold {item.index.fqn!r} at "
                                 f"offsets {tuple(item.index.offset)}, as (global shape, chunk shape, dtype) "
                                 f"{first[1]} and {described}; a replicated tensor must be the same on every rank")


class DefaultSavePlanner(SavePlanner):
    """Writes every value of the (flattened) state_dict; replicated values once."""

    def __init__(self, flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True,
                 dedup_replicated_tensors: bool | None = None, dedup_save_to_lowest_rank: bool = False,
                 enable_plan_caching: bool = False) -> None:
        self.flatten_state_dict = flatten_state_dict
        self.flatten_sharded_tensors = flatten_sharded_tensors
        self.dedup_save_to_lowest_rank = dedup_save_to_lowest_rank
        self.enable_plan_caching = enable_plan_caching  # accepted; plans are cheap to remake here
        self.mappings: FLATTEN_MAPPING = {}

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: StorageMeta | None = None,
                       is_coordinator: bool = False) -> None:
        if self.flatten_state_dict:
            state_dict, self.mappings = flatten_state_dict(state_dict)
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        plan = create_default_local_save_plan(self.state_dict, self.is_coordinator)
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        _check_replicas_agree(all_plans)
        all_plans = dedup_save_plans(all_plans, self.dedup_save_to_lowest_rank)
        if self.flatten_state_dict:
            merged: FLATTEN_MAPPING = {}
            for plan in all_plans:
                merged.update(plan.planner_data or {})
            all_plans = [dataclasses.replace(plan, planner_data=None) for plan in all_plans]
        global_plan, metadata = create_default_global_save_plan(all_plans)
        if self.flatten_state_dict:
            metadata = dataclasses.replace(metadata, planner_data=merged)
        metadata.version = _DCP_VERSION
        self.global_plan, self.metadata = global_plan, metadata
        return global_plan, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        return new_plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        """The value (or, for a tensor, the chunk) that ``index`` names."""
        if index.fqn not in self.state_dict:
            raise ValueError(f"checkpoint save: the plan names {index.fqn!r}, which is not in the state_dict")
        value = self.state_dict[index.fqn]
        view = tensor_view(value)
        if view is None:
            return value
        for chunk in view.chunks:
            if chunk.offsets == index.offset:
                return chunk.tensor
        raise ValueError(f"checkpoint save: this rank holds no chunk of {index.fqn!r} at offsets {index.offset}")

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        value = self.lookup_object(write_item.index)
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save(value, buffer)
            return buffer
        return value.detach()


def _read_items(fqn: str, md: STORAGE_TYPES, value: Any) -> list[ReadItem]:
    if isinstance(md, BytesStorageMetadata):
        index = MetadataIndex(fqn)
        return [ReadItem(LoadItemType.BYTE_IO, index, torch.Size([0]), index, torch.Size([0]), torch.Size([0]))]
    view = tensor_view(value)
    if view is None:
        raise ValueError(f"checkpoint load: {fqn!r} is a tensor of shape {tuple(md.size)} in the checkpoint, but "
                         f"the state_dict to load into holds a {type(value).__name__}; put a tensor of that shape "
                         "there")
    if view.size != md.size:
        raise ValueError(f"Size mismatch between saved {md.size} and current: {view.size} for {fqn}")
    items = []
    for local_index, local in enumerate(view.chunks):
        for saved_index, saved in enumerate(md.chunks):
            box = overlap(saved.offsets, saved.sizes, local.offsets, local.tensor.shape)
            if box is None:
                continue
            storage_offsets, dest_offsets, lengths = box
            items.append(ReadItem(LoadItemType.TENSOR, MetadataIndex(fqn, local.offsets, local_index), dest_offsets,
                                  MetadataIndex(fqn, saved.offsets, saved_index), storage_offsets, lengths))
    return items


def create_default_local_load_plan(state_dict: dict[str, Any], metadata: Metadata,
                                   strict: bool = True) -> LoadPlan:
    """Read items for every value of ``state_dict``; a key the checkpoint lacks is an error when ``strict``."""
    items = []
    for fqn, value in state_dict.items():
        if fqn not in metadata.state_dict_metadata:
            if strict:
                raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
            continue
        items += _read_items(fqn, metadata.state_dict_metadata[fqn], value)
    return LoadPlan(items)


class DefaultLoadPlanner(LoadPlanner):
    """Loads in place: tensors are copied into, other values are replaced in the caller's state_dict."""

    def __init__(self, flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True,
                 allow_partial_load: bool = False) -> None:
        self.flatten_state_dict = flatten_state_dict
        self.flatten_sharded_tensors = flatten_sharded_tensors
        self.allow_partial_load = allow_partial_load
        self.mappings: FLATTEN_MAPPING = {}

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        self.original_state_dict = state_dict
        if self.flatten_state_dict:
            state_dict, self.mappings = flatten_state_dict(state_dict)
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        if self.metadata is None:
            raise ValueError("checkpoint load: the planner has no metadata; call set_up_planner with it first")
        return create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        return new_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=False)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        view = tensor_view(self.state_dict[index.fqn])
        if index.index is not None and index.index < len(view.chunks) and (
                view.chunks[index.index].offsets == index.offset):
            return view.chunks[index.index].tensor
        for chunk in view.chunks:
            if chunk.offsets == index.offset:
                return chunk.tensor
        raise ValueError(f"checkpoint load: this rank holds no chunk of {index.fqn!r} at offsets {index.offset}")

    def transform_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> torch.Tensor:
        return narrow(tensor, read_item.dest_offsets, read_item.lengths)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.transform_tensor(read_item, self.lookup_tensor(read_item.dest_index))

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass
