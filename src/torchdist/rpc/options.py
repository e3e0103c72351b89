"""Configuration and identity: ``TensorPipeRpcBackendOptions``, ``WorkerInfo`` (``BackendType``: see
:mod:`.backend_registry`).

The options class keeps PyTorch's name and signature so that unmodified scripts run;
torchdist has one agent (see :mod:`torchdist.rpc.agent`). Of the TensorPipe specific
arguments, ``_transports`` decides the same-host fast path (:mod:`torchdist.rpc.same_host`):
on unless given without ``"shm"`` (e.g. ``["uv"]``: TCP only); ``_channels`` is accepted
and ignored. Device
maps are validated (1-to-1, as PyTorch requires) and kept: tensors travel through
host memory, so on CPU-only workers a map is a no-op.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from .constants import DEFAULT_INIT_METHOD, DEFAULT_NUM_WORKER_THREADS, DEFAULT_RPC_TIMEOUT_SEC, UNSET_RPC_TIMEOUT

__all__ = ["TensorPipeRpcBackendOptions", "RpcBackendOptions", "WorkerInfo",
           "DEFAULT_RPC_TIMEOUT_SEC", "DEFAULT_NUM_WORKER_THREADS", "DEFAULT_INIT_METHOD", "UNSET_RPC_TIMEOUT",
           "validate_worker_name"]


_NAME_RE = re.compile(r"^[A-Za-z0-9_\-:]*$")
_MAX_NAME_LEN = 128


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's identity: its unique ``name`` and its ``id`` (the rank given to init_rpc).

    Picklable and comparable; printed as PyTorch prints it.
    """

    name: str
    id: int

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"

    __str__ = __repr__


def validate_worker_name(name: Any) -> str:
    """Raise RuntimeError (PyTorch's type) for names that are not ``[A-Za-z0-9_\\-:]{1,127}``."""
    if not isinstance(name, str):
        raise TypeError(f"Worker name must be a str, got {type(name).__name__}")
    if not _NAME_RE.match(name):
        raise RuntimeError(f"Worker name must match ^[A-Za-z0-9-_:]*$, got {name!r}")
    if not name:
        raise RuntimeError("Worker name must be non-empty")
    if len(name) >= _MAX_NAME_LEN:
        raise RuntimeError(f"Worker name must be shorter than {_MAX_NAME_LEN} chars, got {len(name)}: {name[:32]}...")
    return name


def _device(value: int | str | torch.device) -> torch.device:
    return torch.device(value) if not isinstance(value, int) else torch.device("cuda", value)


class RpcBackendOptions:
    """Base of the options classes (PyTorch's ``RpcBackendOptions``)."""

    def __init__(self, rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC, init_method: str = DEFAULT_INIT_METHOD) -> None:
        self.rpc_timeout = float(rpc_timeout)
        self.init_method = init_method


class TensorPipeRpcBackendOptions(RpcBackendOptions):
    """Options of :func:`~torchdist.rpc.init_rpc`, with PyTorch's signature and defaults.

    ``num_worker_threads``: size of the callee thread pool; ``rpc_timeout``: the default
    timeout of every call, in seconds (0 = no timeout); ``init_method``: the rendezvous
    URL (``env://``, ``tcp://host:port``, ``file:///path``).
    """

    def __init__(
        self,
        *,
        num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
        init_method: str = DEFAULT_INIT_METHOD,
        device_maps: dict[str, dict[int | str | torch.device, int | str | torch.device]] | None = None,
        devices: list[int | str | torch.device] | None = None,
        _transports: list | None = None,
        _channels: list | None = None,
    ) -> None:
        super().__init__(rpc_timeout, init_method)
        if not isinstance(num_worker_threads, int) or num_worker_threads < 1:
            raise ValueError(f"num_worker_threads must be a positive int, got {num_worker_threads!r}")
        if self.rpc_timeout < 0:
            raise RuntimeError(f"RPC Timeout must be non-negative (rpc_timeout={rpc_timeout!r} seconds)")
        self.num_worker_threads = num_worker_threads
        self.device_maps: dict[str, dict[torch.device, torch.device]] = {}
        self.devices: list[torch.device] = [_device(d) for d in devices or []]
        self._transports = _transports
        self._channels = _channels
        for to, device_map in (device_maps or {}).items():
            self.set_device_map(to, device_map)

    def set_device_map(self, to: str, device_map: dict[int | str | torch.device, int | str | torch.device]) -> None:
        """Map this worker's devices to ``to``'s devices for tensors sent there; must be 1-to-1."""
        full = dict(self.device_maps.get(to, {}))
        for src, dst in device_map.items():
            src_dev, dst_dev = _device(src), _device(dst)
            if src_dev in full and full[src_dev] != dst_dev:
                raise ValueError(f"`set_device_map` only supports 1-to-1 mapping, trying to map {src_dev} "
                                 f"to {dst_dev} and {full[src_dev]}")
            full[src_dev] = dst_dev
        targets = list(full.values())
        if len(set(targets)) != len(targets):
            raise ValueError(f"`set_device_map` only supports 1-to-1 mapping, got {device_map} for worker {to!r}")
        self.device_maps[to] = full

    def set_devices(self, devices: list[int | str | torch.device]) -> None:
        """Set the local devices this agent may use."""
        self.devices = [_device(d) for d in devices]

    def __repr__(self) -> str:
        return (f"TensorPipeRpcBackendOptions(num_worker_threads={self.num_worker_threads}, "
                f"rpc_timeout={self.rpc_timeout}, init_method={self.init_method!r})")
