"""The one place collectives are reported to whoever watches them (``torchdist.tensor.debug.CommDebugMode``).

Reports name ops the way PyTorch's ``CommDebugMode`` keys them, as ``namespace.op`` strings of
``torch.ops``: a c10d call made by the user (``all_reduce``) is ``c10d.allreduce_``; a collective that
DTensor issues while redistributing is a functional collective in PyTorch (``c10d_functional.all_reduce``), so
the DTensor layer wraps its c10d call in :func:`functional_collective`, which reports that name once and hides
the c10d call inside it.

::

    user: all_reduce(t) ──► member_group ──► report_c10d("all_reduce") ──► listener("c10d.allreduce_")
    DTensor: with functional_collective("c10d_functional.all_reduce"): all_reduce(t)
             ──► listener("c10d_functional.all_reduce"); the inner report_c10d is hidden

Listeners are process-wide (a list, like PyTorch's mode stack, entered and left in LIFO order); with none
registered a report costs one truth test.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

__all__ = ["add_listener", "remove_listener", "report_c10d", "functional_collective", "C10D_OPS"]

#: torchdist's c10d function -> the ``torch.ops.c10d`` op PyTorch's function dispatches (what CommDebugMode counts).
C10D_OPS = {
    "broadcast": "c10d.broadcast_",
    "all_reduce": "c10d.allreduce_",
    "all_reduce_coalesced": "c10d.allreduce_coalesced_",
    "reduce": "c10d.reduce_",
    "all_gather": "c10d.allgather_",
    "all_gather_single": "c10d._allgather_base_",
    "all_gather_coalesced": "c10d.allgather_coalesced_",
    "gather": "c10d.gather_",
    "scatter": "c10d.scatter_",
    "reduce_scatter": "c10d.reduce_scatter_",
    "reduce_scatter_single": "c10d._reduce_scatter_base_",
    "all_to_all": "c10d.alltoall_",
    "all_to_all_single": "c10d.alltoall_base_",
}

_listeners: list[Callable[[str], None]] = []
_hidden = [0]  # depth of functional_collective blocks: c10d calls inside them are not reported again


def add_listener(listener: Callable[[str], None]) -> None:
    """Call ``listener(op_name)`` for every collective this process issues until :func:`remove_listener`."""
    _listeners.append(listener)


def remove_listener(listener: Callable[[str], None]) -> None:
    _listeners.remove(listener)


def _report(name: str) -> None:
    for listener in list(_listeners):
        listener(name)


def report_c10d(function: str) -> None:
    """Called by every c10d function once its group is resolved (this rank takes part); others are ignored."""
    if _listeners and not _hidden[0] and function in C10D_OPS:
        _report(C10D_OPS[function])


@contextlib.contextmanager
def functional_collective(name: str) -> Iterator[None]:
    """Report one collective ``name`` (``"c10d_functional.all_gather_into_tensor"``) for the block, whatever c10d
    calls carry it out."""
    if _listeners and not _hidden[0]:
        _report(name)
    _hidden[0] += 1
    try:
        yield
    finally:
        _hidden[0] -= 1
