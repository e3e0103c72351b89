"""Collectives in ``torch.profiler`` traces, and ``record_comm`` to name them.

While a profiler runs, every op of a backend is one span from the moment it is
issued until it has run, titled as PyTorch's gloo titles its work:
``"<backend>:<op>"``, e.g. ``"shm:all_reduce"``. ``record_comm(name)`` replaces
the title of the ops issued inside it (on this thread), as PyTorch's does.

The span is opened on the issuing thread and closed on whichever thread ran the
op (often the engine's worker): the profiler records only the threads it was
started on, and a span opened there may be closed anywhere (PyTorch's
``record_function`` ends async spans the same way). With no profiler running,
issuing an op costs one attribute read here.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
from torch.autograd import profiler

__all__ = ["record_comm", "Span", "open_span"]

#: The backends' op names (PyTorch's ProcessGroup methods) as PyTorch's titles spell the ops.
_OP_TITLES = {"allreduce": "all_reduce", "allgather": "all_gather", "allgather_into_tensor": "all_gather",
              "reduce_scatter_tensor": "reduce_scatter", "alltoall": "all_to_all"}

_override = threading.local()


@contextlib.contextmanager
def record_comm(name: str) -> Iterator[None]:
    """Title the collectives issued on this thread inside the block ``name`` in profiler traces."""
    previous = getattr(_override, "name", None)
    _override.name = name
    try:
        yield
    finally:
        _override.name = previous


class Span:
    """An open profiler span; ``close`` may run on another thread, and more than once."""

    __slots__ = ("_handle",)

    def __init__(self, title: str) -> None:
        self._handle = torch.ops.profiler._record_function_enter_new(title, None)

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            torch.ops.profiler._record_function_exit._RecordFunction(handle)


def open_span(backend: str, op_name: str) -> Span | None:
    """The span of an op issued now on this thread, or None when no profiler runs."""
    if not profiler._is_profiler_enabled:
        return None
    return Span(getattr(_override, "name", None) or f"{backend}:{_OP_TITLES.get(op_name, op_name)}")
