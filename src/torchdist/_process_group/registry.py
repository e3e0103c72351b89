"""``Backend``: backend names (a ``str`` subclass, as in PyTorch) and the registry of creators.

A *creator* makes one rank's :class:`~torchdist._process_group.backend.ProcessGroupBackend`.
Built-in backends are classes, imported on first use (importing a backend module
costs time and may need optional libraries). Users add theirs with
``Backend.register_backend`` and get PyTorch's calling forms:
``creator(store, rank, size, timeout)``, or with ``extended_api=True``
``creator(DistributedBackendOptions, pg_options)``. :func:`create_backend` calls either.

Names: ``"tcp"`` (sockets), ``"shm"`` (shared memory on one host), ``"auto"`` (the
default CPU backend), ``"gloo"`` (an alias of the default, so unmodified scripts run),
``"mpi"`` (MPI through mpi4py, where it is installed), and PyTorch's other names
(``"nccl"``, ``"ucc"``, ``"xccl"``), which torchdist does not provide: asking for one (or
for ``"mpi"`` without mpi4py) raises a ``RuntimeError`` that says so, as a PyTorch built
without it does.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch

from .backend import ProcessGroupBackend

__all__ = ["Backend", "BackendConfig", "DEFAULT_CPU_BACKEND", "DistributedBackendOptions", "create_backend",
           "is_backend_available", "is_gloo_available", "is_nccl_available", "is_mpi_available", "is_ucc_available",
           "is_xccl_available", "get_default_backend_for_device"]

# Built-in backends: name -> "module:attribute" of the creator, imported on first use.
_BUILTIN_CREATORS: dict[str, str] = {
    "tcp": "torchdist._process_group.backends.tcp:TcpBackend",
    "shm": "torchdist._process_group.backends.shm:ShmBackend",
    "auto": "torchdist._process_group.backends.auto:AutoBackend",
    "mpi": "torchdist._process_group.backends.mpi:MpiBackend",
}
# Names that mean "the default CPU backend".
_DEFAULT_ALIASES = ("auto", "gloo")
DEFAULT_CPU_BACKEND = "auto"  # what backend=None means: the name a default group reports

_custom_creators: dict[str, tuple[Callable, bool]] = {}  # name -> (creator, extended_api)


@dataclass
class DistributedBackendOptions:
    """What an ``extended_api`` creator is given (PyTorch's ``_DistributedBackendOptions``)."""

    store: object
    group_rank: int
    group_size: int
    timeout: timedelta
    group_id: str
    global_ranks_in_group: list[int]

# PyTorch's backends that torchdist does not provide: what each is, for the error.
_NOT_BUILT_IN = {
    "nccl": "NCCL (collectives on NVIDIA GPUs)",
    "ucc": "UCC",
    "xccl": "XCCL (collectives on Intel GPUs)",
}


class Backend(str):
    """A backend name, lower-cased and validated: ``Backend("GLOO") == "gloo"``."""

    UNDEFINED = "undefined"
    GLOO = "gloo"
    NCCL = "nccl"
    UCC = "ucc"
    MPI = "mpi"
    XCCL = "xccl"
    TCP = "tcp"
    SHM = "shm"
    AUTO = "auto"

    backend_list = [UNDEFINED, GLOO, NCCL, XCCL, UCC, MPI, TCP, SHM, AUTO]
    default_device_backend_map = {"cpu": GLOO, "cuda": NCCL, "xpu": XCCL, "mps": GLOO}  # torch's

    def __new__(cls, name: str) -> "Backend":
        if not isinstance(name, str):
            raise ValueError("Backend constructor parameter must be string-ish")
        value = getattr(Backend, name.upper(), Backend.UNDEFINED)
        if value == Backend.UNDEFINED:
            value = name.lower()
        return super().__new__(cls, value)

    @classmethod
    def register_backend(
        cls,
        name: str,
        func: Callable,
        extended_api: bool = False,
        devices: str | list[str] | None = None,
    ) -> None:
        """Register ``func`` under ``name``: ``func(store, rank, size, timeout)``, or with
        ``extended_api`` ``func(DistributedBackendOptions, pg_options)``, returns a
        ``ProcessGroupBackend``. ``devices`` is accepted for PyTorch's signature: torchdist's
        collectives take CPU tensors, and every backend gets them."""
        if not callable(func):
            raise TypeError(f"register_backend: the creator for {name!r} must be callable")
        key = name.lower()
        if hasattr(Backend, name.upper()) or key in _custom_creators:
            raise ValueError(f"{name.upper()} c10d backend already exist")
        setattr(Backend, name.upper(), key)
        Backend.backend_list.append(key)
        _custom_creators[key] = (func, extended_api)


class BackendConfig:
    """The device -> backend map of a backend string such as ``"cpu:tcp,cuda:nccl"``."""

    def __init__(self, backend: str) -> None:
        backend = Backend(backend)
        self.device_backend_map: dict[str, str] = {}
        if ":" not in backend:
            self.device_backend_map["cpu"] = str(backend)
            return
        for pair in backend.split(","):
            device, sep, name = pair.partition(":")
            if not sep or not device or not name:
                raise ValueError(
                    f"Invalid device:backend pairing {pair!r} in backend string {backend!r}; "
                    "the format is '<device>:<backend>,<device>:<backend>', e.g. 'cpu:gloo,cuda:nccl'"
                )
            if device in self.device_backend_map:
                raise ValueError(f"Duplicate device type {device} in backend string {backend!r}")
            self.device_backend_map[device] = Backend(name)

    def get_device_backend_map(self) -> dict[str, str]:
        return dict(self.device_backend_map)

    def __repr__(self) -> str:
        return ",".join(f"{d}:{b}" for d, b in self.device_backend_map.items())


def resolve_cpu_backend(backend: str | None) -> str:
    """The registered name that serves CPU tensors for ``backend`` (None = default)."""
    if backend is None:
        return DEFAULT_CPU_BACKEND
    config = BackendConfig(backend)
    name = config.device_backend_map.get("cpu")
    if name is None:
        raise ValueError(
            f"backend {backend!r} names no backend for CPU tensors; torchdist runs on CPU, "
            "so give e.g. 'cpu:gloo' or leave backend=None"
        )
    return DEFAULT_CPU_BACKEND if name in _DEFAULT_ALIASES else name


def is_backend_available(backend: str) -> bool:
    try:
        _registered(backend)
    except (ValueError, RuntimeError, ImportError):
        return False
    return True


def is_gloo_available() -> bool:
    """``"gloo"`` is always available: an alias of the default CPU backend."""
    return True


def is_nccl_available() -> bool:
    return is_backend_available(Backend.NCCL)


def is_mpi_available() -> bool:
    """Whether mpi4py is installed (checked without starting MPI)."""
    from .backends.mpi import mpi_installed

    return mpi_installed()


def is_ucc_available() -> bool:
    return is_backend_available(Backend.UCC)


def is_xccl_available() -> bool:
    return is_backend_available(Backend.XCCL)


def get_default_backend_for_device(device: str | torch.device) -> str:
    """PyTorch's default backend for a device type (``"cpu"`` -> ``"gloo"``)."""
    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    if device_type not in Backend.default_device_backend_map:
        raise ValueError(f"Default backend not registered for device : {device_type}")
    return Backend.default_device_backend_map[device_type]


def create_backend(name: str | None, store, rank: int, size: int, timeout: timedelta, *, group_name: str,
                   global_ranks: list[int], pg_options=None):
    """This rank's backend of a new group, from the creator registered under ``name``:
    RuntimeError for PyTorch's backends that torchdist does not provide, ValueError for
    unknown names."""
    creator, extended_api = _registered(name)
    if isinstance(creator, type) and issubclass(creator, ProcessGroupBackend):  # torchdist's own form
        return creator(store, rank, size, timeout, group_name=group_name, global_ranks=global_ranks)
    if extended_api:
        return creator(DistributedBackendOptions(store, rank, size, timeout, group_name, list(global_ranks)),
                       pg_options)
    return creator(store, rank, size, timeout)


def _registered(name: str | None) -> tuple[Callable, bool]:
    """The creator that serves ``name`` and whether it takes PyTorch's extended form."""
    key = resolve_cpu_backend(name)
    return _custom_creators.get(key) or (_builtin_class(key), False)


def _builtin_class(name: str) -> type:
    target = _BUILTIN_CREATORS.get(name)
    if target is None and name in _NOT_BUILT_IN:
        raise RuntimeError(
            f"Distributed package doesn't have {_NOT_BUILT_IN[name]} built in: torchdist has no {name!r} "
            "backend; it runs collectives on CPU tensors. Use backend='gloo' or leave it None (shared "
            "memory within a host, TCP across hosts)"
        )
    if target is None:
        known = sorted(set(_BUILTIN_CREATORS) | set(_custom_creators) | set(_DEFAULT_ALIASES))
        raise ValueError(f"Invalid backend: {name!r}. Available backends: {known}, or register one "
                         "with Backend.register_backend")
    module_name, attribute = target.split(":")
    module = importlib.import_module(module_name)
    if name == "mpi" and not module.mpi_installed():
        module.load_mpi()  # raises: what is missing and what to install
    return getattr(module, attribute)
