"""``load_sharded_optimizer_state_dict``: read the optimizer part of an FSDP1 SHARDED_STATE_DICT checkpoint.

The workflow (PyTorch's docstring example)::

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save({"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}, checkpoint_id=path)
    ...
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        optim_state = load_sharded_optimizer_state_dict(state["model"], "optim", dcp.FileSystemReader(path))
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, optim_state["optim"]))

The optimizer's structure is not known before loading, so it is rebuilt from
the checkpoint's metadata: every saved key under ``optimizer_key`` gets a
destination -- ``"<bytes_io>"`` for a non-tensor (replaced by the loaded value),
a plain tensor for a one-element tensor (``step``), and otherwise a DTensor
``Shard(0)`` over the whole world, this rank's dim-0 chunk (``torch.chunk``'s
split, where PyTorch uses a chunk-sharded ShardedTensor: the same boxes). The
flat keys are then loaded with the ordinary load and nested again by the
paths the saving planner recorded (``Metadata.planner_data``).

Not supported: PyTorch's 2-D (FSDP + tensor parallel) layout, where the model
state dict holds ShardedTensors nested in ShardedTensors; torchdist has no
ShardedTensor, so ``model_state_dict`` is only checked, as PyTorch checks it, and
otherwise unused.
"""

from __future__ import annotations

from typing import Any

import torch

from .._c10d.world import WORLD
from ..device_mesh import DeviceMesh
from ..tensor import DTensor, Shard, distribute_tensor
from ._traverse import unflatten_state_dict
from .metadata import BytesStorageMetadata, TensorProperties
from .planner import LoadPlanner
from .state_dict_loader import _load_state_dict
from .storage import StorageReader

__all__ = ["load_sharded_optimizer_state_dict"]


def _check_not_nested(model_state_dict: dict[str, Any]) -> None:
    """PyTorch's refusal of a DTensor nested in a DTensor (``_is_nested_tensor``)."""
    for value in model_state_dict.values():
        if isinstance(value, DTensor) and isinstance(value.to_local(), DTensor):
            raise ValueError("Cannot handle nested DTensor")


def _alloc(properties: TensorProperties, size: torch.Size) -> torch.Tensor:
    # requires_grad is not honoured: the loaded values are copied in place, which a leaf requiring grad refuses
    return torch.empty(size, dtype=properties.dtype, layout=properties.layout, device="cpu")


def load_sharded_optimizer_state_dict(model_state_dict: dict[str, Any], optimizer_key: str,
                                      storage_reader: StorageReader,
                                      planner: LoadPlanner | None = None) -> dict[str, Any]:
    """Load the optimizer state saved under ``optimizer_key``, sharded over the world for this rank.

    Returns the nested state_dict ``{optimizer_key: {"state": ..., "param_groups": ...}}`` whose tensor states
    are DTensors ``Shard(0)`` (one-element states plain tensors), ready for ``FSDP.optim_state_dict_to_load``.
    Every rank must call it; the default process group must be initialized.
    """
    metadata = storage_reader.read_metadata()
    _check_not_nested(model_state_dict)
    default_pg = WORLD.require_default()
    mesh = DeviceMesh.from_group(default_pg, "cpu")
    paths = metadata.planner_data or {}

    state_dict: dict[str, Any] = {}
    for key, value in metadata.state_dict_metadata.items():
        path = paths.get(key)
        if path is None:
            raise ValueError(f"load_sharded_optimizer_state_dict: the checkpoint's metadata has no path for key "
                             f"{key!r}; it must be saved with a flattening planner (the default)")
        if path[0] != optimizer_key:
            continue
        if isinstance(value, BytesStorageMetadata):
            state_dict[key] = "<bytes_io>"
        elif value.size.numel() == 1:
            state_dict[key] = _alloc(value.properties, value.size)
        else:  # allocating the whole tensor as PyTorch does; only this rank's chunk is kept and read
            state_dict[key] = distribute_tensor(_alloc(value.properties, value.size), mesh, [Shard(0)],
                                                src_data_rank=None)

    storage_reader.reset()
    _load_state_dict(state_dict, storage_reader, planner=planner)
    return unflatten_state_dict(state_dict, paths)
