"""``DeviceMesh``: an n-d array of global ranks with one process group per dimension.

A 2x2 mesh ``[[0, 1], [2, 3]]`` named ("dp", "tp") gives rank 2 the "dp" group
[0, 2] (its column) and the "tp" group [2, 3] (its row). The mesh is SPMD: every
rank builds it with the same arguments and so makes the same ``new_group`` calls in
the same order (every group of dimension 0, then of dimension 1, ...), each
described ``"mesh_<dim name>"`` as in PyTorch. A dimension that spans the whole
world reuses the default group instead of creating one.

Slicing (``mesh["dp"]``) and ``_flatten`` make views that share the root mesh's
rank list and reuse its groups; ``_flatten`` and ``_unflatten`` alone create
groups (collectively, on every rank). Positions are bookkept as in PyTorch 2.13 (see ``_layout.py``).
This module is a little under 500 lines because ``DeviceMesh`` is one class with
PyTorch's API surface; its pieces that stand alone live in ``_layout`` and ``_setup``.

Ranks outside the mesh get a mesh all the same: ``get_coordinate()`` is None and,
as in PyTorch, ``get_group()`` raises IndexError (they hold no group).

Device: torchdist communicates CPU tensors. As PyTorch does, the mesh selects the
current accelerator of ``device_type`` when there is one; asking for an
accelerator that torch cannot use under a launcher (LOCAL_RANK set) is an error.
"""

from __future__ import annotations

import math
import threading
import warnings
from typing import Any

import torch

from .._c10d.debug import DebugLevel, get_debug_level
from .._c10d.groups import get_process_group_ranks, new_group
from .._c10d.init import get_rank, get_world_size, init_process_group, is_initialized
from .._c10d.world import WORLD
from .._process_group.process_group import ProcessGroup
from ._layout import MeshLayout, Mode
from ._setup import BackendOverride, normalize_backend_override, select_device

__all__ = ["DeviceMesh", "init_device_mesh"]


class _MeshEnv(threading.local):
    """The meshes entered with ``with mesh:``, innermost last (DTensor's default mesh)."""

    def __init__(self) -> None:
        self.mesh_stack: list[DeviceMesh] = []

    def get_current_mesh(self) -> DeviceMesh:
        if not self.mesh_stack:
            raise RuntimeError("No device mesh is currently active!")
        return self.mesh_stack[-1]


_mesh_resources = _MeshEnv()


def _resolve_group(name: str) -> ProcessGroup:
    pg = WORLD.groups.get(name)
    if pg is None:
        raise RuntimeError(f"Could not resolve the process group registered under the name {name}: it was "
                           "destroyed, or the mesh was built before the last destroy_process_group()")
    return pg


class DeviceMesh:
    """An n-d array of global ranks (``mesh``) with one process group per dimension.

    ``DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))``, called by
    every rank, creates the groups of both dimensions. The underscore arguments are
    PyTorch's private ones, used to build views (slices, flattened meshes).
    """

    def __init__(
        self,
        device_type: str,
        mesh: torch.Tensor | Any | None = None,
        *,
        mesh_dim_names: tuple[str, ...] | None = None,
        backend_override: tuple[BackendOverride, ...] | None = None,
        _init_backend: bool = True,
        _rank: int | None = None,
        _layout: MeshLayout | None = None,
        _rank_map: torch.Tensor | None = None,
        _root_mesh: DeviceMesh | None = None,
    ) -> None:
        if mesh is not None:
            if _layout is not None or _rank_map is not None:
                raise TypeError("Cannot provide _layout and/or _rank_map if passing explicit mesh")
            if isinstance(mesh, torch.Tensor):
                mesh_tensor = mesh.detach().to(device="cpu", dtype=torch.int).contiguous()
            else:
                mesh_tensor = torch.tensor(mesh, device="cpu", dtype=torch.int)
            _layout = MeshLayout.from_sizes_strides(tuple(mesh_tensor.size()), tuple(mesh_tensor.stride()))
            _rank_map = mesh_tensor.flatten()
        elif _layout is None or _rank_map is None:
            raise TypeError("The mesh argument is required except for PRIVATE USAGE ONLY!")
        if not _layout.is_orthogonal():
            raise AssertionError("Please use a non-overlapping layout when creating a DeviceMesh.")
        if _rank_map.ndim != 1 or _rank_map.numel() < _layout.cosize():
            raise AssertionError(f"The rank map of {_rank_map.numel()} elements does not fit the layout {_layout}")

        self._device_type = device_type
        self._layout = _layout
        self._rank_map = _rank_map
        self._mesh_dim_names = tuple(mesh_dim_names) if mesh_dim_names else None
        self._root_mesh = _root_mesh
        if backend_override is None:
            backend_override = ((None, None),) * len(_layout)
        elif len(backend_override) != len(_layout):
            raise ValueError(
                "backend_override should have the same length as the number of mesh dimensions, "
                f"but got {len(backend_override)} and {len(_layout)}."
            )
        self._flatten_rank_map = tuple(_rank_map.tolist())
        self._thread_id = None  # PyTorch's "threaded" test backend, which torchdist does not have
        self._flatten_mapping: dict[str, DeviceMesh] = {}  # on a root mesh: name -> its flattened mesh
        if device_type != "xla":
            if _init_backend:
                self._setup_world_group_and_device()
                self._dim_group_names = self._init_process_groups(_layout, _rank_map, self._mesh_dim_names,
                                                                  backend_override)
            self._rank = get_rank() if _rank is None else _rank
            self._coordinate_on_dim = self._compute_coordinate(self.mesh, self._rank)
        self._hash: int | None = None

    # -- construction ---------------------------------------------------------------
    def _setup_world_group_and_device(self) -> None:
        if not is_initialized():
            init_process_group()
        world_size = get_world_size()
        if self._layout.numel() > world_size:
            raise RuntimeError(f"Mesh should not be bigger than default world size {world_size}, but found "
                               f"{self._layout.numel()} ranks!")
        select_device(self._device_type)

    @staticmethod
    def _init_one_process_group(axis: tuple[Mode, ...], rank_map: torch.Tensor, dim_name: str,
                                backend_override: BackendOverride) -> str | None:
        """Create every group of one dimension (on every rank); the name of this rank's, or None."""
        backend, options = backend_override
        axis_layout = MeshLayout((axis,))
        if axis_layout.numel() == get_world_size() and backend_override == (None, None):
            return WORLD.require_default().group_name
        timeout = getattr(options, "_timeout", None) if options is not None else None
        me = get_rank()
        mine = None
        for ranks in axis_layout.remap_to_tensor(rank_map).tolist():
            pg = new_group(ranks=ranks, timeout=timeout, backend=backend, pg_options=options,
                           group_desc=f"mesh_{dim_name}")
            if me in ranks:
                if mine is not None:
                    raise RuntimeError(f"Each device mesh dimension should get only one process group, but got {me} "
                                       f"in {ranks}!")
                mine = pg.group_name
        return mine

    @staticmethod
    def _init_process_groups(layout: MeshLayout, rank_map: torch.Tensor, mesh_dim_names: tuple[str, ...] | None,
                             backend_override: tuple[BackendOverride, ...]) -> list[str]:
        names = [DeviceMesh._init_one_process_group(layout[dim], rank_map,
                                                    mesh_dim_names[dim] if mesh_dim_names else f"dim_{dim}",
                                                    backend_override[dim])
                 for dim in range(len(layout))]
        # A rank outside the mesh holds no group of any dimension; a rank inside holds one of each.
        return [name for name in names if name is not None]

    @staticmethod
    def _compute_coordinate(mesh: torch.Tensor, rank: int) -> tuple[int, ...] | None:
        found = (mesh == rank).nonzero()
        if found.size(0) not in (0, 1):
            raise AssertionError(f"rank_coords.size(0) must be 0 or 1, got {found.size(0)}")
        return tuple(found[0].tolist()) if found.size(0) else None

    # -- what the mesh is -------------------------------------------------------------
    @property
    def device_type(self) -> str:
        return self._device_type

    @property
    def mesh(self) -> torch.Tensor:
        """The ranks of this mesh; for a slice, the copy of it that holds this rank."""
        full = self._layout.remap_to_tensor(self._rank_map)
        if full.size(0) == 1:
            return full[0]
        mine = (full == get_rank()).nonzero()
        if mine.size(0) > 0:
            return full[mine[0, 0]]
        raise RuntimeError("In order to get the mesh Tensor of a DeviceMesh it needs to either have all its original "
                           "dimensions (e.g., no slicing) or it needs to contain the local rank")

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        return self._mesh_dim_names

    @property
    def ndim(self) -> int:
        return len(self._layout)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._layout.sizes

    def size(self, mesh_dim: int | None = None) -> int:
        return self._layout.numel() if mesh_dim is None else self._layout.sizes[mesh_dim]

    def get_rank(self) -> int:
        """This process's global rank."""
        return get_rank()

    def get_coordinate(self) -> tuple[int, ...] | None:
        """This rank's index along each dimension; None when the rank is not in the mesh."""
        return self._coordinate_on_dim

    def _is_current_rank_part_of_mesh(self) -> bool:
        return self._coordinate_on_dim is not None

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's rank in the group of ``mesh_dim`` (required when ndim > 1)."""
        if self.ndim > 1 and mesh_dim is None:
            raise RuntimeError(f"Found the DeviceMesh have {self.ndim} dimensions",
                               "Optional kwarg `mesh_dim` needs to be specified when device_mesh.ndim > 1.")
        return get_rank(self.get_group(0 if mesh_dim is None else mesh_dim))

    # -- groups ---------------------------------------------------------------------------
    def get_group(self, mesh_dim: int | str | None = None) -> ProcessGroup:
        """The process group of ``mesh_dim`` (an index or a name; may be omitted on a 1-D mesh)."""
        if not hasattr(self, "_dim_group_names"):
            raise RuntimeError("DeviceMesh process groups not initialized!")
        if self.ndim > 1 and mesh_dim is None:
            raise RuntimeError(
                f"Found the DeviceMesh have {self.ndim} dimensions",
                "Optional kwarg `mesh_dim` needs to be specified when device_mesh.ndim > 1.",
                "If you want to get the list of all the ProcessGroups in the DeviceMesh,"
                "please use `get_all_groups()` instead.",
            )
        if mesh_dim is None:
            return _resolve_group(self._dim_group_names[0])
        flattened = self._get_root_mesh()._flatten_mapping
        if mesh_dim in flattened:
            return _resolve_group(flattened[mesh_dim]._dim_group_names[0])
        if isinstance(mesh_dim, str):
            mesh_dim = self._get_mesh_dim_by_name(mesh_dim)
        return _resolve_group(self._dim_group_names[mesh_dim])

    def get_all_groups(self) -> list[ProcessGroup]:
        return [self.get_group(dim) for dim in range(self.ndim)]

    def _get_mesh_dim_by_name(self, mesh_dim_name: str) -> int:
        if not self._mesh_dim_names:
            raise KeyError("No `mesh_dim_names` found.")
        if mesh_dim_name not in self._mesh_dim_names:
            raise KeyError(f"Mesh dimension '{mesh_dim_name}' does not exist.",
                           f"Available mesh dimensions are: mesh_dim_names={self._mesh_dim_names}")
        return self._mesh_dim_names.index(mesh_dim_name)

    # -- views: slices and flattened meshes ----------------------------------------------
    def _get_root_mesh(self) -> DeviceMesh:
        return self._root_mesh if self._root_mesh is not None else self

    def _get_root_mesh_dim(self) -> int | None:
        """The index in the root mesh of this 1-D slice's dimension."""
        if self._mesh_dim_names:
            if len(self._mesh_dim_names) != 1:
                raise AssertionError("The submesh can only be a 1D mesh.")
            return self._get_root_mesh()._get_mesh_dim_by_name(self._mesh_dim_names[0])
        return None

    def __getitem__(self, mesh_dim_names: str | tuple[str, ...]) -> DeviceMesh:
        """The submesh of the named dimensions, in the root's order: ``mesh["dp"]``, ``mesh["dp", "tp"]``."""
        if not self._mesh_dim_names:
            raise RuntimeError("Cannot slice a DeviceMesh without mesh_dim_names!")
        names = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
        if names == self._mesh_dim_names:
            return self
        root = self._get_root_mesh()
        # Names made by _flatten can be sliced from the root mesh only (deprecated in PyTorch).
        flattened = {name: mesh._layout[0] for name, mesh in root._flatten_mapping.items()} if self == root else {}
        valid = [*self._mesh_dim_names, *flattened]
        if not all(name in valid for name in names):
            raise KeyError(f"Invalid mesh_dim_names {names} specified. Valid mesh_dim_names are {valid}.")
        axes, group_names = [], []
        holds_groups = bool(getattr(self, "_dim_group_names", None))
        for name in names:
            if name in self._mesh_dim_names:
                dim = self._mesh_dim_names.index(name)
                axes.append(self._layout[dim])
                if holds_groups:
                    group_names.append(self._dim_group_names[dim])
            else:
                warnings.warn("Slicing a flattened dim from root mesh will be deprecated in PT 2.11. "
                              "Users need to bookkeep the flattened mesh directly. ", stacklevel=2)
                axes.append(flattened[name])
                if holds_groups:
                    group_names.append(root._flatten_mapping[name]._dim_group_names[0])
        layout = MeshLayout(tuple(axes))
        if not layout.is_sorted():
            raise KeyError(f"Invalid mesh_dim_names {names} specified. Mesh dim indices should be in ascending order.")
        if not layout.is_orthogonal():
            raise RuntimeError(f"Slicing overlapping dim_names {names} is not allowed.")
        submesh = DeviceMesh(self._device_type, _layout=layout, _rank_map=root._rank_map, mesh_dim_names=names,
                             _root_mesh=root, _init_backend=False)
        if hasattr(self, "_dim_group_names"):
            submesh._dim_group_names = group_names
        return submesh

    def _flatten(self, mesh_dim_name: str | None = None, backend_override: Any = None) -> DeviceMesh:
        """This mesh as one dimension named ``mesh_dim_name`` (default: the names joined by "_").

        Every rank calls it: it creates the new dimension's groups. The root mesh
        remembers it, so ``root.get_group(name)`` and ``root[name]`` find it.
        """
        if not self._mesh_dim_names:
            raise RuntimeError("Cannot flatten a DeviceMesh without mesh_dim_names!")
        if not mesh_dim_name:
            mesh_dim_name = "_".join(self._mesh_dim_names)
        if self.ndim == 1 and mesh_dim_name in self._mesh_dim_names:
            return self
        override = (next(normalize_backend_override({0: backend_override}, 1)) if backend_override is not None
                    else (None, None))
        root = self._get_root_mesh()
        taken = root._mesh_dim_names or ()
        if mesh_dim_name in taken:
            raise ValueError(f"{mesh_dim_name} already exists for submesh of the {root}. ",
                             f"The mesh_dim_names of submesh and flattened mesh are {taken}. "
                             "Please specify another valid mesh_dim_name.")
        layout = MeshLayout((self._layout.collapse(),))
        existing = root._flatten_mapping.get(mesh_dim_name)
        if existing is not None:
            if existing._layout == layout:
                return existing
            raise ValueError(f"Flatten mesh with mesh_dim_name {mesh_dim_name} has been created before, "
                             "Please specify another valid mesh_dim_name.")
        flat = DeviceMesh(root._device_type, _layout=layout, _rank_map=root._rank_map, mesh_dim_names=(mesh_dim_name,),
                          _root_mesh=root, backend_override=(override,))
        root._flatten_mapping[mesh_dim_name] = flat
        return flat

    def _unflatten(self, dim: int | str, mesh_sizes: tuple[int, ...], mesh_dim_names: tuple[str, ...],
                   backend_override: dict | None = None) -> DeviceMesh:
        """This mesh with dimension ``dim`` split into dimensions of ``mesh_sizes`` named
        ``mesh_dim_names``: a 1-D mesh of 8 ranks unflattened to (2, 4) is the 2x4 mesh.

        Every rank calls it: if this mesh holds groups, the new dimensions' groups are
        created (as ``init_device_mesh`` would); the other dimensions keep theirs.
        """
        if isinstance(dim, int) and dim >= self.ndim:
            raise ValueError(f"dim {dim} specified in `_unflatten` is out of range {self.ndim}")
        if isinstance(dim, str) and dim not in (self._mesh_dim_names or ()):
            raise ValueError(f"dim {dim} specified in `_unflatten` is not in {self._mesh_dim_names}")
        if len(mesh_sizes) != len(mesh_dim_names):
            raise RuntimeError("mesh_dim_names must have same length as mesh_sizes in _unflatten!")
        if isinstance(dim, str):
            dim = self._mesh_dim_names.index(dim)
        if math.prod(mesh_sizes) != self._layout.sizes[dim]:
            raise ValueError(f"The product of mesh_sizes={tuple(mesh_sizes)} is {math.prod(mesh_sizes)}, but the "
                             f"original dimension at dim={dim} has size {self._layout.sizes[dim]}. These must be "
                             "equal for unflatten to work correctly.")
        override = (tuple(normalize_backend_override(backend_override, len(mesh_sizes), tuple(mesh_dim_names)))
                    if backend_override is not None else ((None, None),) * len(mesh_sizes))
        layout = self._layout.unflatten(dim, tuple(mesh_sizes))
        names = list(self._mesh_dim_names or (f"dim_{d}" for d in range(self.ndim)))
        names[dim:dim + 1] = mesh_dim_names
        root = self._get_root_mesh()
        unflattened = DeviceMesh(self._device_type, _layout=layout, _rank_map=root._rank_map,
                                 mesh_dim_names=tuple(names), _root_mesh=root, _init_backend=False)
        if hasattr(self, "_dim_group_names"):
            group_names = list(self._dim_group_names)
            split = MeshLayout(layout.axes[dim:dim + len(mesh_sizes)])
            group_names[dim:dim + 1] = self._init_process_groups(split, root._rank_map, tuple(mesh_dim_names),
                                                                 override)
            unflattened._dim_group_names = group_names
        return unflattened

    def _get_all_submeshes(self, mesh_dim_name: str) -> list[DeviceMesh]:
        """Every 1-D submesh along ``mesh_dim_name``, not only this rank's."""
        dim = self._get_mesh_dim_by_name(mesh_dim_name)
        me = self.get_rank()
        submeshes = []
        for ranks in MeshLayout((self._layout[dim],)).remap_to_tensor(self._rank_map):
            submesh = DeviceMesh(self._device_type, ranks, mesh_dim_names=(mesh_dim_name,), _init_backend=False)
            submesh._dim_group_names = [self._dim_group_names[dim]] if me in ranks else []
            submeshes.append(submesh)
        return submeshes

    @staticmethod
    def from_group(group: ProcessGroup | list[ProcessGroup], device_type: str, mesh: torch.Tensor | Any | None = None,
                   *, mesh_dim_names: tuple[str, ...] | None = None) -> DeviceMesh:
        """A mesh over existing groups: one group gives a 1-D mesh, a list needs ``mesh`` and ``mesh_dim_names``."""
        if isinstance(group, ProcessGroup):
            ranks = get_process_group_ranks(group)
            given = mesh.tolist() if isinstance(mesh, torch.Tensor) else mesh
            if mesh is not None and given != ranks:
                raise ValueError(f"Invalid mesh {str(mesh)} for ProcessGroup with ranks {ranks}")
            device_mesh = DeviceMesh(device_type, torch.tensor(ranks, dtype=torch.int), mesh_dim_names=mesh_dim_names,
                                     _init_backend=False)
            device_mesh._dim_group_names = [group.group_name]
            return device_mesh
        groups = list(group)
        if not groups:
            raise ValueError("Expects at least one ProcessGroup to be passed")
        if mesh is None:
            raise ValueError("Must pass mesh if passing multiple ProcessGroups")
        if mesh_dim_names is None:
            raise ValueError("Must pass mesh_dim_names if passing multiple ProcessGroups")
        mesh = (mesh.detach().to(dtype=torch.int, device="cpu") if isinstance(mesh, torch.Tensor)
                else torch.tensor(mesh, dtype=torch.int))
        if mesh.ndim != len(groups):
            raise ValueError("Expects mesh with ndim equal to number of ProcessGroups but got "
                             f"mesh {mesh.tolist()} and {len(groups)} ProcessGroups")
        device_mesh = DeviceMesh(device_type, mesh, mesh_dim_names=mesh_dim_names, _init_backend=False)
        device_mesh._dim_group_names = [pg.group_name for pg in groups]
        return device_mesh

    # -- identity -------------------------------------------------------------------------
    def _hash_key(self) -> tuple:
        return (self._flatten_rank_map, self._layout, self._device_type, self._mesh_dim_names, self._thread_id)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(self._hash_key())
        return self._hash

    def __eq__(self, other: object) -> bool:
        # Slices compare equal across ranks: they share the root's ranks and the layout, whichever copy they are.
        if self is other:
            return True
        return isinstance(other, DeviceMesh) and self._hash_key() == other._hash_key()

    def __repr__(self) -> str:
        sizes = self._layout.sizes
        shape = (f"({', '.join(f'{n}={s}' for n, s in zip(self._mesh_dim_names, sizes))})" if self._mesh_dim_names
                 else f"{sizes}")
        text = f"DeviceMesh({shape}, '{self._device_type}', stride={self._layout.repr_strides()}"
        if get_debug_level() == DebugLevel.DETAIL:
            text += f", Mesh: {self.mesh.tolist()}"
        return text + ")"

    def __enter__(self) -> DeviceMesh:
        _mesh_resources.mesh_stack.append(self)
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        _mesh_resources.mesh_stack.pop()


def init_device_mesh(
    device_type: str,
    mesh_shape: tuple[int, ...],
    *,
    mesh_dim_names: tuple[str, ...] | None = None,
    backend_override: dict | None = None,
) -> DeviceMesh:
    """A mesh of ranks 0..N-1 in row-major order with shape ``mesh_shape``; every rank calls it.

    Initializes the default process group (from the environment) if needed.
    ``backend_override`` maps a dimension (index or name) to a backend name,
    backend options, or both as a tuple.
    """
    if mesh_dim_names is not None:
        if len(set(mesh_dim_names)) != len(mesh_dim_names):
            raise RuntimeError("Each mesh_dim_name must be unique. "
                               f"Found repeated mesh_dim_name in mesh_dim_names {mesh_dim_names}")
        if len(mesh_shape) != len(mesh_dim_names):
            raise RuntimeError("mesh_shape and mesh_dim_names should have same length! Found len(mesh_dim_names): "
                               f"{len(mesh_dim_names)} and len(mesh_shape):{len(mesh_shape)}.")
    override = (tuple(normalize_backend_override(backend_override, len(mesh_shape), mesh_dim_names))
                if backend_override is not None else None)
    if device_type and not device_type.isalpha():
        raise RuntimeError(f"Device type with index is not supported but got {device_type}. ",
                           "If you maintained a 'torch.device' object, it's recommended to pass in 'device.type'.")
    layout = MeshLayout.from_sizes_strides(tuple(mesh_shape))
    return DeviceMesh(device_type, _layout=layout, _rank_map=torch.arange(layout.numel(), dtype=torch.int),
                      mesh_dim_names=mesh_dim_names, backend_override=override)
