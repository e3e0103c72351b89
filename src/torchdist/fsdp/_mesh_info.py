"""Where a ``fully_shard`` group lives: its mesh, which mesh dimension shards and which replicates (HSDP).

Vocabulary used across this package: the *shard group* is the process group of
the shard mesh dimension (parameters are all-gathered and gradients
reduce-scattered over it); the *replicate group* is the other dimension of a 2-D
(HSDP) mesh (gradients are all-reduced over it after the reduce-scatter).

Full SPMD mesh (``fully_shard(mesh=full, dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...))``): the
user's mesh holds every parallelism (e.g. ``("rep", "shard", "tp")``) and the parameters are already DTensors on
it. The data-parallel mesh is cut out of it (several shard or replicate dims flattened into one each, HSDP's pair
concatenated as ``(replicate, shard)``) and FSDP runs on that exactly as for a 1-D/2-D mesh; the full mesh and the
names are kept (``spmd_mesh``, ``dp_mesh_dims``) for the parameters' layouts, as PyTorch's ``is_spmd_mesh`` does.
With ``replicate`` only (DDP-style, PyTorch's ``DDPMeshInfo``) there is no shard dim: the shard "group" is this
rank alone (nothing is gathered or scattered) and gradients are only all-reduced over the replicate group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._c10d.init import get_world_size, init_process_group, is_initialized
from .._process_group.process_group import ProcessGroup
from ..device_mesh import DeviceMesh, init_device_mesh
from ..device_mesh._layout import MeshLayout

__all__ = ["MeshInfo", "default_mesh", "mesh_info_of", "concatenate_meshes"]


@dataclass(frozen=True)
class MeshInfo:
    """A 1-D mesh (FSDP: ``shard_mesh_dim=0``) or a 2-D one (HSDP: replicate on dim 0, shard on dim 1); on a full
    SPMD mesh also a 1-D replicate-only one (DDP: ``shard_mesh_dim=None, replicate_mesh_dim=0``)."""

    mesh: DeviceMesh
    shard_mesh_dim: int | None
    replicate_mesh_dim: int | None = None
    spmd_mesh: DeviceMesh | None = None  # the user's full mesh, with dp_mesh_dims (a DataParallelMeshDims) naming
    dp_mesh_dims: Any = None  # ... its data-parallel dims; None for a plain 1-D/2-D data-parallel mesh

    @property
    def is_spmd(self) -> bool:
        return self.spmd_mesh is not None

    @property
    def shard_group(self) -> ProcessGroup | None:
        return None if self.shard_mesh_dim is None else self.mesh.get_group(self.shard_mesh_dim)

    @property
    def shard_size(self) -> int:
        return 1 if self.shard_mesh_dim is None else self.mesh.size(self.shard_mesh_dim)

    @property
    def shard_rank(self) -> int:
        return 0 if self.shard_mesh_dim is None else self.mesh.get_local_rank(self.shard_mesh_dim)

    @property
    def replicate_group(self) -> ProcessGroup | None:
        return None if self.replicate_mesh_dim is None else self.mesh.get_group(self.replicate_mesh_dim)

    @property
    def replicate_size(self) -> int:
        return 1 if self.replicate_mesh_dim is None else self.mesh.size(self.replicate_mesh_dim)

    def placements(self, shard: Any) -> tuple:
        """The DTensor placements of a sharded parameter: ``(shard,)`` or ``(Replicate(), shard)``."""
        from ._dtensor import Replicate

        return (shard,) if self.replicate_mesh_dim is None else (Replicate(), shard)


def default_mesh() -> DeviceMesh:
    """A 1-D CPU mesh over the default group, initializing it (env://) first if needed, as PyTorch does."""
    if not is_initialized():
        init_process_group()
    return init_device_mesh("cpu", (get_world_size(),))


def mesh_info_of(mesh: DeviceMesh, dp_mesh_dims: Any = None) -> MeshInfo:
    """Check ``mesh`` (1-D or named 2-D) and say which dimension shards, as ``fully_shard`` does."""
    if dp_mesh_dims is not None:
        return _spmd_mesh_info(mesh, dp_mesh_dims)
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}")
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise AssertionError("Please init the 2D mesh for HSDP with mesh_dim_names specified")
    if mesh.device_type != "cpu":
        raise ValueError(f"fully_shard: torchdist runs FSDP on CPU meshes only, got a {mesh.device_type!r} mesh; "
                         "build the mesh with init_device_mesh('cpu', ...)")
    return MeshInfo(mesh, 0) if mesh.ndim == 1 else MeshInfo(mesh, 1, 0)


def _spmd_mesh_info(mesh: DeviceMesh, dims: Any) -> MeshInfo:
    """The data-parallel part of a full SPMD mesh, checked as PyTorch checks it (``_validate_mesh``)."""
    if dims.shard is None and dims.replicate is None:
        raise ValueError("At least one of shard or replicate must be set in dp_mesh_dims")
    if mesh.mesh_dim_names is None:
        raise ValueError("mesh must have mesh_dim_names when dp_mesh_dims is provided")
    for name in (*dims.shard_names, *dims.replicate_names):
        if name not in mesh.mesh_dim_names:
            raise ValueError(f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {mesh.mesh_dim_names}")
    if mesh.device_type != "cpu":
        raise ValueError(f"fully_shard: torchdist runs FSDP on CPU meshes only, got a {mesh.device_type!r} mesh; "
                         "build the mesh with init_device_mesh('cpu', ...)")

    def one_dim(names: tuple[str, ...]) -> DeviceMesh:  # several dims become one, with its own process group
        return mesh[names[0]] if len(names) == 1 else mesh[names]._flatten("_".join(names))

    if not dims.shard_names:  # DDP
        return MeshInfo(one_dim(dims.replicate_names), None, 0, spmd_mesh=mesh, dp_mesh_dims=dims)
    shard = one_dim(dims.shard_names)
    if not dims.replicate_names:
        return MeshInfo(shard, 0, spmd_mesh=mesh, dp_mesh_dims=dims)
    dp_mesh = concatenate_meshes([one_dim(dims.replicate_names), shard])
    return MeshInfo(dp_mesh, 1, 0, spmd_mesh=mesh, dp_mesh_dims=dims)


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose dimensions are those of ``meshes`` in order (e.g. FSDP's "dp" then TP's "tp"), sharing their
    root's ranks and process groups; as PyTorch's ``DeviceMesh._concatenate``, nothing is communicated."""
    rank_map = meshes[0]._flatten_rank_map
    axes, names, group_names = [], [], []
    for mesh in meshes:
        if mesh._flatten_rank_map != rank_map:
            raise RuntimeError("Cannot concatenate DeviceMeshes derived from different device meshs")
        if mesh.mesh_dim_names is None:
            raise AssertionError(f"FSDP with DTensor parameters needs named meshes (init_device_mesh(..., "
                                 f"mesh_dim_names=...)), got {mesh}")
        axes.extend(mesh._layout.axes)
        names.extend(mesh.mesh_dim_names)
        group_names.extend(mesh._dim_group_names)
    layout = MeshLayout(tuple(axes))
    if not layout.is_orthogonal():
        raise RuntimeError(f"Cannot concatenate overlapping meshes: {meshes}")
    root = meshes[0]._get_root_mesh()
    if names == list(root.mesh_dim_names or ()) and layout == root._layout:
        return root
    mesh = DeviceMesh(meshes[0].device_type, _layout=layout, _rank_map=meshes[0]._rank_map,
                      mesh_dim_names=tuple(names), _root_mesh=root, _init_backend=False)
    mesh._dim_group_names = group_names
    return mesh
