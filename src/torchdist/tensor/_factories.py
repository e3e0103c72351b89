"""DTensor factories: ``zeros, ones, empty, full, rand, randn`` of a global size, made block by block.

Each rank makes only its own block. Random blocks come from each rank's own
default generator: PyTorch's DTensor keeps a distributed RNG only on CUDA-like
meshes, and on a CPU mesh its ``rand_like``/``dropout`` draw per rank in the
same way (so equal seeds give equal blocks). PyTorch 2.13's ``rand``/``randn``
factories fail on CPU meshes (a bare AssertionError); here they draw per rank
with a warning, as its random ops do.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch

from ..device_mesh import DeviceMesh
from ._api import DTensor, _current_mesh
from ._placements import Placement, Replicate
from ._spec import DTensorSpec, TensorMeta, compute_local_shape_and_global_offset, contiguous_strides, \
    normalize_placements

__all__ = ["zeros", "ones", "empty", "full", "rand", "randn"]


def _size(size: tuple) -> torch.Size:
    if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)):
        size = tuple(size[0])
    return torch.Size(size)


def _make(init: Any, size: tuple, device_mesh: DeviceMesh | None, placements: Sequence[Placement] | None,
          dtype: torch.dtype | None, layout: torch.layout, requires_grad: bool, **extra: Any) -> DTensor:
    mesh = _current_mesh(device_mesh)
    shape = _size(size)
    placements = placements or [Replicate() for _ in range(mesh.ndim)]
    placements = normalize_placements(placements, mesh, len(shape), init.__name__)
    if layout != torch.strided:
        raise NotImplementedError(f"torchdist.tensor.{init.__name__}: only torch.strided layout is supported, "
                                  f"got {layout}")
    local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
    kwargs = {"dtype": dtype, "layout": layout, "device": mesh.device_type if mesh.device_type != "cpu" else "cpu"}
    if init in (torch.rand, torch.randn):
        warnings.warn(f"DTensor random operators may not have complete support on {mesh.device_type} device mesh",
                      stacklevel=3)
    if init is torch.full:
        local = torch.full(local_shape, extra["fill_value"], **kwargs)
    else:
        local = init(local_shape, **kwargs)
    spec = DTensorSpec(mesh, placements, TensorMeta(shape, contiguous_strides(shape), local.dtype))
    return DTensor(local, spec, requires_grad=requires_grad)


def ones(*size, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided, requires_grad: bool = False,
         device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None) -> DTensor:
    """A DTensor of ones of global ``size``."""
    return _make(torch.ones, size, device_mesh, placements, dtype, layout, requires_grad)


def zeros(*size, requires_grad: bool = False, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
          device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None) -> DTensor:
    """A DTensor of zeros of global ``size``."""
    return _make(torch.zeros, size, device_mesh, placements, dtype, layout, requires_grad)


def empty(*size, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided, requires_grad: bool = False,
          device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None) -> DTensor:
    """An uninitialized DTensor of global ``size``."""
    return _make(torch.empty, size, device_mesh, placements, dtype, layout, requires_grad)


def full(size, fill_value, *, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
         requires_grad: bool = False, device_mesh: DeviceMesh | None = None,
         placements: Sequence[Placement] | None = None) -> DTensor:
    """A DTensor of global ``size`` filled with ``fill_value``."""
    return _make(torch.full, (size,), device_mesh, placements, dtype, layout, requires_grad, fill_value=fill_value)


def rand(*size, requires_grad: bool = False, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
         device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None) -> DTensor:
    """Uniform [0, 1) values; each rank draws its block from its own generator (see the module docstring)."""
    return _make(torch.rand, size, device_mesh, placements, dtype, layout, requires_grad)


def randn(*size, requires_grad: bool = False, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
          device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None) -> DTensor:
    """Standard normal values; each rank draws its block from its own generator (see the module docstring)."""
    return _make(torch.randn, size, device_mesh, placements, dtype, layout, requires_grad)
