"""What a DeviceMesh takes from its arguments and environment: per-dimension backends, the device.

``backend_override`` maps a dimension (index or name) to a backend name, backend
options, or both as a tuple; :func:`normalize_backend_override` turns it into one
(backend, options) pair per dimension. :func:`select_device` is PyTorch's
heuristic for choosing this process's accelerator before groups are created.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Iterator

import torch

from .._c10d.init import get_node_local_rank, get_rank, get_world_size

__all__ = ["BackendOverride", "normalize_backend_override", "select_device"]

_log = logging.getLogger(__name__)

BackendOverride = tuple[str | None, Any]  # (backend name, backend options)


def normalize_backend_override(backend_override: dict, ndim: int,
                               mesh_dim_names: tuple[str, ...] | None = None) -> Iterator[BackendOverride]:
    """Yield (backend, options) per dimension from ``{dim index or name: backend | options | (backend, options)}``."""
    backend_override = dict(backend_override)
    names = mesh_dim_names or ()
    for dim in range(ndim):
        name = names[dim] if dim < len(names) else None
        if name is not None and name in backend_override:
            if dim in backend_override:
                raise RuntimeError(f"Found redundant dim index {dim} and name {name} in backend_override")
            value = backend_override.pop(name)
        elif dim in backend_override:
            value = backend_override.pop(dim)
        else:
            yield (None, None)
            continue
        if isinstance(value, str):
            yield (value, None)
        elif isinstance(value, tuple):
            yield value
        else:
            yield (None, value)
    if backend_override:
        raise RuntimeError(f"Found invalid keys in backend_override: got {list(backend_override.keys())}, "
                           f"expected integers in range [0, {ndim}) or one of {names}")


def select_device(device_type: str) -> None:
    """Select this process's ``device_type`` device unless the user did: PyTorch's heuristic."""
    handle = getattr(torch, device_type, None)
    if handle is None or not hasattr(handle, "is_initialized") or handle.is_initialized():
        return
    local_rank = get_node_local_rank(fallback_rank=-1)
    if local_rank >= 0:
        if not handle.is_available():  # PyTorch fails inside set_device (AttributeError, AssertionError)
            raise RuntimeError(
                f"DeviceMesh: device_type {device_type!r} is not available in this process "
                f"(torch.{device_type}.is_available() is False), so it cannot select device LOCAL_RANK={local_rank}. "
                "torchdist communicates CPU tensors: use device_type='cpu'."
            )
        _log.info("Setting default device for the current process based on LOCAL_RANK=%s", local_rank)
        handle.set_device(local_rank)
        return
    per_host = handle.device_count()
    if per_host == 0:
        return
    warnings.warn(
        "It seems like you did not set/select the default device for the current process before the DeviceMesh "
        "initialization or use a launcher (i.e. torchrun) which populates `LOCAL_RANK` environment variable. "
        "DeviceMesh will use a heuristic to set the device_id via `global_rank % num_devices_per_host`, "
        "assuming homogeneous hardware cluster.",
        stacklevel=3,
    )
    world_size = get_world_size()
    if world_size > per_host and world_size % per_host != 0:
        raise RuntimeError(f"DeviceMesh only support homogeneous hardware, but found {world_size} ranks and "
                           f"{per_host} {device_type} devices!")
    handle.set_device(get_rank() % per_host)

