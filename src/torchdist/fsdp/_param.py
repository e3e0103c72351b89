"""One parameter under FSDP: its shard layout, its sharded DTensor and its unsharded stand-in.

Sharding follows ``torch.chunk`` on the shard dim ``d`` over the ``W`` ranks of
a shard group: every rank owns ``c = ceil(size(d) / W)`` rows except that the
last ranks may own fewer, or none. In the flat communication buffers every
rank's shard is padded to ``c`` rows, so each rank contributes the same number
of elements (``padded_numel``) per parameter:

    flat buffer of one rank:  [ p0 shard, padded | p1 shard, padded | ... ]
    all-gather output:        [ rank 0's flat buffer | rank 1's | ... ]

The unsharded parameter is one ``nn.Parameter`` object for the life of the
module (autograd saves it in forward and finds it again in backward); resharding
frees its storage (``resize_(0)``) and unsharding refills it, without bumping its
version counter, as PyTorch's FSDP2 does.

A parameter that is already a DTensor (tensor parallelism on a "tp" mesh) is
sharded the same way, but FSDP cuts its TP-local block: the unsharded parameter
is the TP DTensor (so TP's forward is unchanged) and the sharded one is a DTensor
on the concatenated ``(dp, tp)`` mesh with placements ``(dp placement, *TP's)``,
the dp placement being ``_StridedShard(d, split_factor=tp)`` when TP also shards
dim ``d`` (FSDP's rows are taken within each TP block), as in PyTorch.

On a full SPMD mesh (``dp_mesh_dims``) every parameter is a DTensor on the user's whole mesh, Replicate on the
data-parallel dims, and is handled as the TP case above with the whole DTensor as "TP's": FSDP cuts its local
block, the unsharded parameter is that DTensor again, and the sharded one lives on the same mesh, in its dim
order, the data-parallel shard dim's Replicate() replaced by ``Shard(d)`` (``_StridedShard(d, split_factor=s)``,
``s`` the number of shards of ``d`` over the later mesh dims). Several shard dims are flattened into one, and the
sharded parameter's mesh then has that flattened dim in their place, as in PyTorch.

With ``reshard_after_forward=k`` (an int) a parameter has a second, *post-forward*
layout over groups of ``k`` ranks: between forward and backward each rank keeps a
``1/k`` shard of the unsharded parameter, and backward all-gathers only within
its group of ``k``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..device_mesh import DeviceMesh
from ..tensor._placements import _StridedShard, is_shard_like
from ..tensor._spec import DTensorSpec, contiguous_strides
from ._dtensor import DTensor, Replicate, Shard, local_of, sharded_parameter, sharded_tensor
from ._mesh_info import MeshInfo, concatenate_meshes
from ._storage import alloc_storage, free_storage

__all__ = ["ParamSlot", "ShardLayout", "FSDPParam"]


@dataclass(frozen=True)
class ParamSlot:
    """A place the parameter is registered: ``module._parameters[name]``."""

    module: nn.Module
    name: str

    def set(self, param: nn.Parameter) -> None:
        # bypass nn.Module.__setattr__: the slot already holds a parameter, we only swap which one
        self.module._parameters[self.name] = param


@dataclass(frozen=True)
class ShardLayout:
    """How a tensor of ``shape`` is cut along ``dim`` over ``world`` ranks, seen from ``rank``."""

    shape: torch.Size
    dim: int
    world: int
    rank: int

    @property
    def chunk_rows(self) -> int:
        return math.ceil(self.shape[self.dim] / self.world)

    @property
    def start(self) -> int:
        return min(self.rank * self.chunk_rows, self.shape[self.dim])

    @property
    def local_rows(self) -> int:
        return min(self.chunk_rows, self.shape[self.dim] - self.start)

    @property
    def padded_shard_shape(self) -> torch.Size:
        shape = list(self.shape)
        shape[self.dim] = self.chunk_rows
        return torch.Size(shape)

    @property
    def padded_numel(self) -> int:
        return self.padded_shard_shape.numel()

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``full`` (a view)."""
        return full.narrow(self.dim, self.start, self.local_rows)

    def padded_flat(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` padded with zeros to ``chunk_rows`` rows, flattened: this rank's part of an all-gather."""
        if self.local_rows == self.chunk_rows:
            return local.reshape(-1)
        padded = local.new_zeros(self.padded_shard_shape)
        padded.narrow(self.dim, 0, self.local_rows).copy_(local)
        return padded.reshape(-1)

    def unpadded(self, gathered: torch.Tensor) -> torch.Tensor:
        """The full tensor (a view) from its ``(world, padded_numel)`` columns of an all-gather output."""
        full = gathered.reshape(self.world, *self.padded_shard_shape).movedim(0, self.dim)
        full = full.reshape(*self.shape[:self.dim], self.world * self.chunk_rows, *self.shape[self.dim + 1:])
        return full.narrow(self.dim, 0, self.shape[self.dim])

    def scatter_block(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` zero-padded to ``world * chunk_rows`` rows as a ``(world, padded_numel)`` block, row r for
        rank r: this tensor's part of a reduce-scatter input."""
        rows = self.world * self.chunk_rows
        if rows != self.shape[self.dim]:
            shape = list(self.shape)
            shape[self.dim] = rows
            padded = full.new_zeros(shape)
            padded.narrow(self.dim, 0, self.shape[self.dim]).copy_(full)
            full = padded
        split = full.reshape(*self.shape[:self.dim], self.world, self.chunk_rows, *self.shape[self.dim + 1:])
        return split.movedim(self.dim, 0).reshape(self.world, self.padded_numel)

    def unpad_local(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's rows from its padded flat shard."""
        return flat.reshape(self.padded_shard_shape).narrow(self.dim, 0, self.local_rows)


class FSDPParam:
    """Sharded and unsharded forms of one original parameter, and conversions between them and the flat buffers."""

    def __init__(self, param: nn.Parameter, slots: list[ParamSlot], mesh_info: MeshInfo, shard_dim: int,
                 param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None, fqn: str) -> None:
        self.mesh_info = mesh_info
        self.slots = slots
        self.fqn = fqn
        self.shape = param.shape  # the global shape (of the TP DTensor, if the parameter is one)
        self.stride = contiguous_strides(param.shape)
        if mesh_info.is_spmd:
            _check_spmd_param(param, mesh_info, slots[0].name)
        self.tp_spec: DTensorSpec | None = param._spec if isinstance(param, DTensor) else None
        data = local_of(param)  # what FSDP shards: the TP-local block, or the parameter itself
        self.local_shape = data.shape
        self.orig_dtype = param.dtype
        self.requires_grad = param.requires_grad
        # mixed precision only for floating-point parameters, and only where it changes something
        self.param_dtype = param_dtype if param_dtype not in (None, param.dtype) and param.is_floating_point() \
            else None
        self.reduce_dtype = reduce_dtype if reduce_dtype != param_dtype else None
        self.layout = ShardLayout(data.shape, shard_dim, mesh_info.shard_size, mesh_info.shard_rank)
        self.mesh, self.placements = self._sharded_layout(shard_dim)
        with torch.no_grad():
            local = self.layout.local(data).clone(memory_format=torch.contiguous_format)
        self.sharded_param = sharded_parameter(local, self.mesh, self.placements, self.shape, self.stride,
                                               self.requires_grad)
        self._unsharded: nn.Parameter | None = None  # created at the first unshard
        self.accumulated_grad: torch.Tensor | None = None  # unsharded, in reduce dtype, across no-sync steps
        self.post_forward_layout: ShardLayout | None = None  # reshard_after_forward=int: over groups of k ranks
        self.post_forward_local: torch.Tensor | None = None  # ... and this rank's 1/k shard kept after forward
        self.register(self.sharded_param)

    def _sharded_layout(self, shard_dim: int) -> tuple[DeviceMesh, tuple]:
        """The mesh and placements of the sharded parameter: FSDP's mesh, or for a TP DTensor the FSDP and TP meshes
        concatenated, FSDP's placement strided over the TP shards of the same dim (PyTorch's ``_StridedShard``)."""
        if self.tp_spec is None:
            return self.mesh_info.mesh, self.mesh_info.placements(Shard(shard_dim))
        if self.mesh_info.is_spmd:
            return _spmd_sharded_layout(self.tp_spec, self.mesh_info, shard_dim)
        tp = self.tp_spec
        if len(tp.placements) > 2:
            raise NotImplementedError(f"FSDP only supports 1D TP/EP or 2D EP+TP, not {tp.placements}")
        split = math.prod(tp.mesh.size(i) for i, p in enumerate(tp.placements)
                          if is_shard_like(p) and p.dim == shard_dim)
        dp_placement: Any = _StridedShard(shard_dim, split_factor=split) if split > 1 else Shard(shard_dim)
        mesh = concatenate_meshes([self.mesh_info.mesh, tp.mesh])
        if not 2 <= mesh.ndim <= 4:
            raise AssertionError("_spmd_mesh.ndim can only be 2 (FSDP+TP/EP), 3 (FSDP+EP+TP, HSDP+TP/EP), "
                                 f"or 4 (HSDP+EP+TP) but got {mesh.ndim}.")
        return mesh, (*self.mesh_info.placements(dp_placement), *tp.placements)

    # -- registration ------------------------------------------------------------------------------------

    def register(self, param: nn.Parameter) -> None:
        for slot in self.slots:
            slot.set(param)

    def refresh_sharded(self) -> None:
        """Pick up a sharded parameter that was replaced on the module (``load_state_dict(assign=True)``)."""
        current = self.slots[0].module._parameters[self.slots[0].name]
        if current is not self.sharded_param and current is not self._unsharded and isinstance(current, type(
                self.sharded_param)) and self.post_forward_local is None:
            self.sharded_param = current

    @property
    def all_gather_dtype(self) -> torch.dtype:
        return self.param_dtype or self.orig_dtype

    # -- unsharded parameter -------------------------------------------------------------------------------

    @property
    def unsharded_param(self) -> nn.Parameter:
        """The gathered parameter: a plain one, or a DTensor with TP's layout over the gathered TP-local block."""
        if self._unsharded is None:
            local = torch.empty(self.local_shape, dtype=self.all_gather_dtype)
            if self.tp_spec is None:
                self._unsharded = nn.Parameter(local, requires_grad=self.requires_grad)
            else:
                self._unsharded = sharded_parameter(local, self.tp_spec.mesh, self.tp_spec.placements, self.shape,
                                                    self.tp_spec.stride, self.requires_grad)
            free_storage(_data(self._unsharded))
        return self._unsharded

    def all_gather_input(self, layout: ShardLayout) -> torch.Tensor:
        """This rank's padded flat part of an all-gather in ``layout``: from the sharded parameter (cast to the
        all-gather dtype) or, for the post-forward layout, from the kept post-forward shard."""
        if layout is self.layout:
            return layout.padded_flat(local_of(self.sharded_param).to(self.all_gather_dtype))
        assert self.post_forward_local is not None, f"{self}: no post-forward shard to gather"
        return layout.padded_flat(self.post_forward_local)

    def copy_out(self, gathered: torch.Tensor, layout: ShardLayout) -> None:
        """Fill the unsharded parameter from its ``(W, padded_numel)`` columns of an all-gather output."""
        data = _data(self.unsharded_param)
        alloc_storage(data)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(data):
            data.copy_(layout.unpadded(gathered))
        self.post_forward_local = None

    def free_unsharded(self) -> None:
        if self._unsharded is not None:
            free_storage(_data(self._unsharded))
        self.post_forward_local = None

    def to_post_forward(self, mesh_info: MeshInfo) -> None:
        """Keep this rank's ``1/k`` shard of the unsharded parameter, register it as a DTensor on the post-forward
        mesh, and free the unsharded storage."""
        if self.tp_spec is not None:
            raise NotImplementedError("Resharding to smaller mesh is not supported for DTensor parameters yet")
        layout = self.post_forward_layout = ShardLayout(self.shape, self.layout.dim, mesh_info.shard_size,
                                                        mesh_info.shard_rank)
        with torch.no_grad():
            self.post_forward_local = layout.local(self.unsharded_param.detach()).clone()
        placements = mesh_info.placements(Shard(layout.dim))
        self.register(sharded_parameter(self.post_forward_local, mesh_info.mesh, placements, self.shape, self.stride,
                                        self.requires_grad))
        free_storage(self.unsharded_param)

    # -- gradients -----------------------------------------------------------------------------------------

    def take_unsharded_grad(self) -> torch.Tensor | None:
        """The gradient to reduce (accumulated over no-sync steps, if any), detached from the parameter."""
        param = self._unsharded
        grad = param.grad if param is not None else None
        if param is not None:
            param.grad = None
        grad = self.local_grad(grad) if grad is not None else None
        if self.accumulated_grad is not None:
            total, self.accumulated_grad = self.accumulated_grad, None
            return total if grad is None else total + grad.to(total.dtype)
        return grad

    def keep_unsharded_grad(self) -> None:
        """No-sync backward: keep the gradient for the next one. Autograd adds to ``.grad`` by itself; only a
        gradient to upcast to ``reduce_dtype`` moves aside (and later ones are added to it in that dtype)."""
        param = self._unsharded
        if param is None or param.grad is None:
            return
        if self.accumulated_grad is not None:
            self.accumulated_grad += self.local_grad(param.grad)
            param.grad = None
        elif self.reduce_dtype is not None and param.grad.dtype != self.reduce_dtype:
            self.accumulated_grad, param.grad = self.local_grad(param.grad).to(self.reduce_dtype), None

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient of the unsharded parameter as FSDP reduces it: a TP DTensor gradient in TP's placements
        (a Partial one is reduced over TP first), its local block."""
        if not isinstance(grad, DTensor):
            return grad
        target = self.tp_spec.placements
        if self.mesh_info.is_spmd:  # leave the data-parallel dims (Partial, say) to FSDP's reduce-scatter
            dp_dims = _dp_dim_indices(self.mesh_info)
            target = tuple(grad.placements[i] if i in dp_dims else p for i, p in enumerate(target))
        if grad.placements != target:
            with torch.no_grad():
                grad = grad.redistribute(placements=target)
        return grad._local_tensor

    def accumulate_sharded_grad(self, reduced: torch.Tensor) -> None:
        """Add this rank's reduced, padded flat shard to ``sharded_param.grad`` (a DTensor like the parameter)."""
        local = self.layout.unpad_local(reduced).to(self.orig_dtype).contiguous()
        param = self.sharded_param
        if param.grad is not None:
            local = local_of(param.grad) + local
        param.grad = sharded_tensor(local, self.mesh, self.placements, self.shape, self.stride)

    def __repr__(self) -> str:
        return f"FSDPParam({self.fqn or '?'}, shape={tuple(self.shape)}, placements={self.placements})"


def _dp_dim_indices(mesh_info: MeshInfo) -> list[int]:
    """Indices in the full SPMD mesh of the data-parallel dims: shard ones first, then replicate ones."""
    names = mesh_info.spmd_mesh.mesh_dim_names
    dims = mesh_info.dp_mesh_dims
    return [names.index(n) for n in (*dims.shard_names, *dims.replicate_names)]


def _check_spmd_param(param: nn.Parameter, mesh_info: MeshInfo, name: str) -> None:
    """A parameter on a full SPMD mesh: a DTensor on that very mesh, Replicate() on every data-parallel dim."""
    if not isinstance(param, DTensor):
        raise ValueError("When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh (e.g. "
                         f"via distribute_module). Got plain tensor for parameter '{name}'.")
    mesh = param.device_mesh
    if mesh is not mesh_info.spmd_mesh:
        raise ValueError("Expected param's DTensor mesh to be the same mesh passed to fully_shard, but got different "
                         "mesh objects")
    n_shard = len(mesh_info.dp_mesh_dims.shard_names)
    for k, i in enumerate(_dp_dim_indices(mesh_info)):
        if not isinstance(param.placements[i], Replicate):
            kind = "shard" if k < n_shard else "replicate"
            raise ValueError(f"Expected Replicate() on DP {kind} dim '{mesh.mesh_dim_names[i]}' (index {i}) but got "
                             f"{param.placements[i]}")


def _spmd_sharded_layout(spec: DTensorSpec, mesh_info: MeshInfo, shard_dim: int) -> tuple[DeviceMesh, tuple]:
    """Mesh and placements of a sharded parameter on a full SPMD mesh (see the module docstring)."""
    mesh, names = spec.mesh, spec.mesh.mesh_dim_names
    shard_names = mesh_info.dp_mesh_dims.shard_names
    placements = list(spec.placements)
    for i in (names.index(n) for n in shard_names):
        split = math.prod(mesh.size(j) for j in range(i + 1, mesh.ndim)
                          if is_shard_like(placements[j]) and placements[j].dim == shard_dim)
        placements[i] = _StridedShard(shard_dim, split_factor=split) if split > 1 else Shard(shard_dim)
    if len(shard_names) <= 1:  # (none: replicate-only, the parameter keeps its layout)
        return mesh, tuple(placements)
    # the shard dims flattened: the data-parallel mesh (HSDP: with its replicate dim) takes the first one's place
    # (in mesh order), the others and HSDP's replicate dims drop out
    replicate_names = set(mesh_info.dp_mesh_dims.replicate_names)
    hsdp = mesh_info.replicate_mesh_dim is not None
    first = min(names.index(n) for n in shard_names)
    meshes, out = [], []
    for i, name in enumerate(names):
        if i == first:
            meshes.append(mesh_info.mesh)
            out.extend((Replicate(), placements[i]) if hsdp else (placements[i],))
        elif name not in shard_names and not (hsdp and name in replicate_names):
            meshes.append(mesh[name])
            out.append(placements[i])
    return concatenate_meshes(meshes), tuple(out)


def _data(param: torch.Tensor) -> torch.Tensor:
    """The tensor that owns ``param``'s storage: its local block if it is a DTensor."""
    return param._local_tensor if isinstance(param, DTensor) else param
