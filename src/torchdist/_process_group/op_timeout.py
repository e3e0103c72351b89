"""An op's own timeout (PyTorch's ``AllreduceOptions.timeout`` and friends), for the backends.

PyTorch's ``ProcessGroup`` op methods take a timeout per op; the c10d functions that
torchdist's methods are built on do not, and neither do the backends' op methods.
So a method sets the timeout here around its call, and a backend reads it when it
issues the op, on the caller's thread: the op's deadline is fixed at issue, also when
the op then runs on the backend's worker. Unset (the usual case), ops run under their
group's timeout.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from datetime import timedelta
from typing import Iterator

__all__ = ["op_timeout", "op_seconds"]

_OP_SECONDS: ContextVar[float | None] = ContextVar("torchdist_op_timeout", default=None)


@contextlib.contextmanager
def op_timeout(timeout: timedelta | None) -> Iterator[None]:
    """Ops issued inside the block time out after ``timeout`` (None: their group's)."""
    token = _OP_SECONDS.set(None if timeout is None else timeout.total_seconds())
    try:
        yield
    finally:
        _OP_SECONDS.reset(token)


def op_seconds(seconds: float | None = None) -> float | None:
    """``seconds`` if given, else the timeout of the op being issued; None: the group's."""
    return seconds if seconds is not None else _OP_SECONDS.get()
