"""Making DTensors from whole tensors and modules: ``distribute_tensor``, ``distribute_module``.

``distribute_tensor`` takes the data from one rank (``src_data_rank``, as
PyTorch does): a Shard dimension scatters that rank's chunks, a Replicate
dimension broadcasts, so ranks need not hold the same tensor beforehand.
``src_data_rank=None`` skips the communication and cuts each rank's own tensor.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from .._c10d.collectives import broadcast, scatter
from ..device_mesh import DeviceMesh
from ._api import DTensor, _current_mesh
from ._placements import Partial, Placement, Replicate, Shard, shard_size_and_offset
from ._spec import DTensorSpec, TensorMeta, normalize_placements

__all__ = ["distribute_tensor", "distribute_module"]


def _group_rank_of(mesh: DeviceMesh, mesh_dim: int, src_data_rank: int) -> int:
    """The sender in mesh dimension ``mesh_dim``'s group: PyTorch uses ``src_data_rank`` as a group rank there."""
    if not 0 <= src_data_rank < mesh.size(mesh_dim):
        raise RuntimeError(f"distribute_tensor: invalid root rank: src_data_rank {src_data_rank} is not a rank of "
                           f"mesh dimension {mesh_dim} (size {mesh.size(mesh_dim)}) of {mesh}; PyTorch takes it as "
                           "the rank within each mesh dimension's group")
    return src_data_rank


def _scatter_dim(tensor: torch.Tensor, mesh: DeviceMesh, mesh_dim: int, dim: int, src: int) -> torch.Tensor:
    """This rank's chunk along ``dim`` of the group source's ``tensor`` (padded scatter for uneven chunks)."""
    world = mesh.size(mesh_dim)
    if world == 1:
        return tensor
    rank = mesh.get_local_rank(mesh_dim)
    pieces, _ = Shard(dim)._split_tensor(tensor, world, with_padding=True)
    out = torch.empty_like(pieces[0])
    scatter(out, pieces if rank == src else None, group_src=src, group=mesh.get_group(mesh_dim))
    return out.narrow(dim, 0, shard_size_and_offset(tensor.size(dim), world, rank)[0]).contiguous()


def distribute_tensor(tensor: torch.Tensor, device_mesh: DeviceMesh | None = None,
                      placements: Sequence[Placement] | None = None, *, src_data_rank: int | None = 0) -> DTensor:
    """``tensor`` (as held by ``src_data_rank``) laid out over the mesh with ``placements`` (default Replicate).

    A leaf that requires grad gives a leaf DTensor that requires grad.
    """
    mesh = _current_mesh(device_mesh)
    if placements is None:
        placements = [Replicate() for _ in range(mesh.ndim)]
    placements = normalize_placements(placements, mesh, tensor.ndim, "distribute_tensor")
    if isinstance(tensor, DTensor):
        if tensor.device_mesh != mesh:
            raise ValueError(f"Cannot distribute a DTensor with device mesh {tensor.device_mesh} to a different "
                             f"device mesh {mesh}.")
        if tensor.placements != placements:
            raise ValueError(f"Cannot distribute a DTensor with placements {tensor.placements} to a different "
                             f"placements {placements}. do you want to call `redistribute` instead?")
        return tensor
    if any(isinstance(p, Partial) for p in placements):
        raise RuntimeError("distribute_tensor: Partial placements are not supported; distribute with Replicate or "
                           "Shard, or build a Partial DTensor with DTensor.from_local")
    local = tensor.detach()
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        local = local.new_empty(0)
    else:
        # Broadcast first (whole tensor on Replicate dims), then cut: outer mesh dimensions first.
        if src_data_rank is not None:
            for mesh_dim, placement in enumerate(placements):
                if isinstance(placement, Replicate) and mesh.size(mesh_dim) > 1:
                    local = local.contiguous().clone()
                    broadcast(local, group_src=_group_rank_of(mesh, mesh_dim, src_data_rank),
                              group=mesh.get_group(mesh_dim))
        for mesh_dim, placement in enumerate(placements):
            if isinstance(placement, Shard):
                if src_data_rank is None:
                    length, offset = shard_size_and_offset(local.size(placement.dim), mesh.size(mesh_dim),
                                                           coordinate[mesh_dim])
                    local = local.narrow(placement.dim, offset, length)
                else:
                    local = _scatter_dim(local.contiguous(), mesh, mesh_dim, placement.dim,
                                         _group_rank_of(mesh, mesh_dim, src_data_rank))
        local = local.contiguous()
        if local.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
            local = local.clone()  # a view of the caller's tensor (any rank's block, not only the first)
    spec = DTensorSpec(mesh, placements, TensorMeta(tensor.shape, tensor.stride(), tensor.dtype))
    return DTensor(local.requires_grad_(False), spec, requires_grad=tensor.requires_grad)


def _replicate_module_params(module: nn.Module, mesh: DeviceMesh) -> None:
    full = [Replicate() for _ in range(mesh.ndim)]
    for name, param in list(module._parameters.items()):
        if param is not None and not isinstance(param, DTensor):
            module.register_parameter(name, nn.Parameter(distribute_tensor(param.data, mesh, full),
                                                         requires_grad=param.requires_grad))
    for name, buffer in list(module._buffers.items()):
        if buffer is not None and not isinstance(buffer, DTensor):
            module._buffers[name] = distribute_tensor(buffer, mesh, full)


def distribute_module(module: nn.Module, device_mesh: DeviceMesh | None = None,
                      partition_fn: Callable[[str, nn.Module, DeviceMesh], None] | None = None,
                      input_fn: Callable[..., Any] | None = None,
                      output_fn: Callable[..., Any] | None = None) -> nn.Module:
    """Make ``module``'s parameters and buffers DTensors and install input/output conversion hooks.

    ``partition_fn(name, submodule, mesh)`` lays out each submodule's parameters (default: Replicate every one
    that is not a DTensor yet); ``input_fn(module, inputs, mesh)`` and ``output_fn(module, outputs, mesh)``
    become forward pre-/post-hooks.
    """
    mesh = _current_mesh(device_mesh)
    if getattr(module, "_distribute_module_applied", False):
        raise RuntimeError("distribute_module should only be called once on a module, but it has already been "
                           "called on this module!")
    for name, submodule in module.named_modules():
        if partition_fn is None:
            _replicate_module_params(submodule, mesh)
        else:
            partition_fn(name, submodule, mesh)
            _replicate_module_params(submodule, mesh)
    if input_fn is not None:
        if len(inspect.signature(input_fn).parameters) == 2:  # PyTorch's deprecated (inputs, device_mesh) form
            warnings.warn("Deprecating input_fn that takes two arguments (inputs, device_mesh), please use "
                          "input_fn that takes in (module, inputs, device_mesh) instead!", FutureWarning, stacklevel=2)
            module.register_forward_pre_hook(lambda mod, inputs: input_fn(inputs, mesh))
        else:
            module.register_forward_pre_hook(lambda mod, inputs: input_fn(mod, inputs, mesh))
    if output_fn is not None:
        if len(inspect.signature(output_fn).parameters) == 2:
            warnings.warn("Deprecating output_fn that takes two arguments (inputs, device_mesh), please use "
                          "output_fn that takes in (module, inputs, device_mesh) instead!", FutureWarning, stacklevel=2)
            module.register_forward_hook(lambda mod, inputs, outputs: output_fn(outputs, mesh))
        else:
            module.register_forward_hook(lambda mod, inputs, outputs: output_fn(mod, outputs, mesh))
    module._distribute_module_applied = True
    return module
