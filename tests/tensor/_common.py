"""The harness of the DTensor tests: one body run under torch.distributed.tensor (gloo) and under torchdist.tensor.

A body ``fn(rank, world, lib, mesh_shape)`` gets the modules of ``lib`` from
:func:`libs`, records observations with :func:`observe` (a DTensor becomes its
global shape, placements and local block; an error its type and text), and the
test compares every rank's observations between the two libraries: exactly,
except floats, which may differ by summation order (relative 1e-5).
"""

from __future__ import annotations

import importlib
import math
import warnings
from typing import Any, Callable

import torch

from torchdist.testing import run_ranks

# (world size, mesh shape): 1 to 4 ranks, and 4 as a 2x2 mesh.
MESHES = [(1, (1,)), (2, (2,)), (3, (3,)), (4, (2, 2))]


class Lib:
    """The c10d, device_mesh and tensor modules of torch or torchdist, and a mesh of ``shape``."""

    def __init__(self, lib: str, shape: tuple[int, ...]) -> None:
        self.name = lib
        if lib == "torch":
            import torch.distributed as c10d

            c10d.init_process_group("gloo")
            self.c10d = c10d
            self.T = importlib.import_module("torch.distributed.tensor")
            from torch.distributed.device_mesh import init_device_mesh
        else:
            import torchdist as c10d

            self.c10d = c10d
            self.T = importlib.import_module("torchdist.tensor")
            from torchdist.device_mesh import init_device_mesh
        self.mesh = init_device_mesh("cpu", shape)
        self.ndim = len(shape)
        self.S, self.R, self.P = self.T.Shard, self.T.Replicate, self.T.Partial

    def close(self) -> None:
        if self.name == "torch":
            self.c10d.destroy_process_group()


def describe(value: Any) -> Any:
    """A comparable, picklable description of ``value``."""
    if isinstance(value, torch.Tensor) and hasattr(value, "placements"):
        local = value._local_tensor
        return ("DTensor", tuple(value.shape), tuple(str(p) for p in value.placements), str(value.dtype),
                local.tolist(), value.requires_grad)
    if isinstance(value, torch.Tensor):
        return ("Tensor", tuple(value.shape), str(value.dtype), value.tolist())
    if isinstance(value, torch.Size):
        return tuple(value)
    if isinstance(value, (list, tuple)):
        return type(value).__name__, [describe(v) for v in value]
    if hasattr(value, "is_shard") and hasattr(value, "is_partial"):  # a placement, of either library
        return str(value)
    return value


def observe(fn: Callable[[], Any], message: bool = True) -> Any:
    """What ``fn()`` gave, described, or its error's type and first line (``message=False``: the type only,
    where torchdist's message says more than PyTorch's)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ("ok", describe(fn()))
    except Exception as exc:  # noqa: BLE001 - the error is the observation
        text = str(exc).splitlines()[0] if str(exc) and message else ""
        return ("error", type(exc).__name__, text)


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-5 * max(1.0, abs(a), abs(b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


def compare(body: Callable, world: int, shape: tuple[int, ...], *args: Any, timeout: float = 120) -> list[dict]:
    """Run ``body`` under both libraries; assert every rank observed the same; return torchdist's observations."""
    want = run_ranks(body, world, args=("torch", shape, *args), timeout=timeout)
    got = run_ranks(body, world, args=("torchdist", shape, *args), timeout=timeout)
    problems = []
    for rank, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys()
        for key in w:
            if not _close(g[key], w[key]):
                problems.append(f"rank {rank}, {key}:\n  torchdist {g[key]!r}\n  torch     {w[key]!r}")
    assert not problems, f"world {world} mesh {shape}: " + "\n".join(problems[:8])
    return got
