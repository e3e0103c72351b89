"""``DTensorSpec``: what a DTensor is besides its local tensor (mesh, placements, global shape, stride, dtype).

Also the arithmetic between global and local shapes: which block of the global
tensor a rank holds, given its mesh coordinate and the placements (shards of the
same tensor dimension on several mesh dimensions nest, the earlier mesh
dimension outermost, as in PyTorch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from ..device_mesh import DeviceMesh
from ._placements import Placement, Shard, _StridedShard, is_shard_like, shard_indices, shard_size_and_offset

__all__ = ["TensorMeta", "DTensorSpec", "compute_local_shape_and_global_offset", "normalize_placements",
           "contiguous_strides", "global_shape_from_local"]


class TensorMeta(NamedTuple):
    """The global tensor's shape, stride and dtype."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class DTensorSpec:
    """A DTensor's layout: the mesh, one placement per mesh dimension, and the global tensor's metadata."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    tensor_meta: TensorMeta

    @property
    def device_mesh(self) -> DeviceMesh:
        return self.mesh

    @property
    def shape(self) -> torch.Size:
        return self.tensor_meta.shape

    @property
    def stride(self) -> tuple[int, ...]:
        return self.tensor_meta.stride

    @property
    def ndim(self) -> int:
        return len(self.tensor_meta.shape)

    @property
    def num_shards(self) -> int:
        """How many pieces the shards cut the tensor into."""
        count = 1
        for mesh_dim, placement in enumerate(self.placements):
            if is_shard_like(placement):
                count *= self.mesh.size(mesh_dim)
        return count

    def is_replicated(self) -> bool:
        return all(p.is_replicate() for p in self.placements)

    def has_partial(self) -> bool:
        return any(p.is_partial() for p in self.placements)

    def with_placements(self, placements: Sequence[Placement]) -> DTensorSpec:
        return DTensorSpec(self.mesh, tuple(placements), self.tensor_meta)

    def __repr__(self) -> str:
        return f"DTensorSpec(mesh={self.mesh}, placements={self.placements}, tensor_meta={self.tensor_meta})"


def normalize_placements(placements: Sequence[Placement], mesh: DeviceMesh, ndim: int,
                         op: str) -> tuple[Placement, ...]:
    """Placements checked against the mesh and the tensor's rank, negative shard dims made positive."""
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise ValueError(f"{op}: the mesh has {mesh.ndim} dimension(s) but {len(placements)} placement(s) were "
                         f"given ({placements}); give one placement per mesh dimension")
    out = []
    for placement in placements:
        if not isinstance(placement, Placement):
            raise TypeError(f"{op}: placements must be Shard, Replicate or Partial, got {placement!r}")
        if is_shard_like(placement):
            dim = placement.dim
            if not -ndim <= dim < max(ndim, 1) or ndim == 0:
                what = f"Shard({dim})" if isinstance(placement, Shard) else repr(placement)
                raise IndexError(f"{op}: {what} is out of range for a tensor with {ndim} dimension(s)")
            if dim < 0:
                placement = Shard(dim + ndim) if isinstance(placement, Shard) else \
                    _StridedShard(dim + ndim, split_factor=placement.split_factor)
        out.append(placement)
    return tuple(out)


def compute_local_shape_and_global_offset(global_shape: Sequence[int], mesh: DeviceMesh,
                                          placements: Sequence[Placement],
                                          coordinate: Sequence[int] | None = None
                                          ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape of the block this rank (or the rank at ``coordinate``) holds, and where it starts in the global tensor.

    A rank outside the mesh holds nothing: shape ``(0,)`` and offset ``()``, as in PyTorch.
    """
    coordinate = mesh.get_coordinate() if coordinate is None else coordinate
    if coordinate is None:
        return (0,), ()
    if any(isinstance(p, _StridedShard) for p in placements):
        return _strided_local_shape_and_offset(global_shape, mesh, placements, coordinate)
    shape, offset = list(global_shape), [0] * len(global_shape)
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            length, start = shard_size_and_offset(shape[placement.dim], mesh.size(mesh_dim), coordinate[mesh_dim])
            shape[placement.dim] = length
            offset[placement.dim] += start
    return tuple(shape), tuple(offset)


def _strided_local_shape_and_offset(global_shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement],
                                    coordinate: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """As PyTorch with a ``_StridedShard``: follow the global rows each sharded dim keeps, mesh dim by mesh dim; the
    offset is the first kept row (the dim's size when none is kept)."""
    rows: dict[int, list[int]] = {}
    for mesh_dim, placement in enumerate(placements):
        if is_shard_like(placement):
            held = rows.get(placement.dim, list(range(global_shape[placement.dim])))
            chosen = shard_indices(placement, len(held), mesh.size(mesh_dim), coordinate[mesh_dim])
            rows[placement.dim] = [held[i] for i in chosen]
    shape, offset = list(global_shape), [0] * len(global_shape)
    for dim, held in rows.items():
        shape[dim] = len(held)
        offset[dim] = held[0] if held else global_shape[dim]
    return tuple(shape), tuple(offset)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def global_shape_from_local(local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]
                            ) -> tuple[torch.Size, tuple[int, ...]]:
    """The global shape and stride of a tensor whose shards all have ``local``'s shape (from_local's assumption)."""
    shape = list(local.shape)
    stride = list(local.stride())
    for mesh_dim, placement in enumerate(placements):
        if is_shard_like(placement):
            k = mesh.size(mesh_dim)
            for d in range(len(shape)):  # dimensions laid out outside the sharded one grow with it
                if d != placement.dim and stride[d] >= stride[placement.dim] * max(shape[placement.dim], 1):
                    stride[d] *= k
            shape[placement.dim] *= k
    return torch.Size(shape), tuple(stride)

