"""``Work``: the handle of one collective or point-to-point operation.

State machine (transitions happen once, under a lock)::

    PENDING ──_complete(result)──▶ COMPLETED    wait() returns True, result() gives the outputs
       │
       └─────_fail(exc)──────────▶ FAILED       wait() re-raises exc, exception() returns it

A backend that finishes an op on the caller's thread hands back a Work that is
already COMPLETED; one that queues the op on its progress thread completes the
Work from there. ``get_future()`` returns a ``torch.futures.Future`` tied to the same
outcome, so DDP comm hooks and ``torch.futures.wait_all`` compose with it.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from datetime import timedelta
from typing import Callable

import torch

from .._transport.thread_roles import after_release, settle_callbacks
from ..errors import DistBackendError

__all__ = ["Work", "WorkState", "settle_future_callbacks"]

logger = logging.getLogger(__name__)


class WorkState(enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"


class Work:
    """Handle of an operation in flight; ``wait()`` blocks until it is done or failed."""

    def __init__(self, op_name: str = "", outputs: list[torch.Tensor] | None = None) -> None:
        self.op_name = op_name
        self._outputs = outputs if outputs is not None else []
        self._state = WorkState.PENDING
        self._exception: BaseException | None = None
        self._sender_rank = -1
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._future: torch.futures.Future | None = None
        self._settling: int | None = None  # the thread completing the future, meanwhile
        self._callbacks: list[Callable[["Work"], None]] = []

    @staticmethod
    def completed(op_name: str, outputs: list[torch.Tensor] | None = None) -> "Work":
        """A Work for an op that already finished on the caller's thread (see ``_CompletedWork``)."""
        return _CompletedWork(op_name, outputs)

    # -- completion (called by backends) -------------------------------------------
    def _complete(self, source_rank: int | None = None) -> None:
        with self._lock:
            if self._state is not WorkState.PENDING:
                return
            if source_rank is not None:
                self._sender_rank = source_rank
            self._state = WorkState.COMPLETED
            callbacks, self._callbacks = self._callbacks, []
        self._run_callbacks(callbacks)

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._state is not WorkState.PENDING:
                return
            self._exception = exc
            self._state = WorkState.FAILED
            callbacks, self._callbacks = self._callbacks, []
        self._run_callbacks(callbacks)

    def _run_callbacks(self, callbacks: list[Callable[["Work"], None]]) -> None:
        # Callbacks run before waiters wake: the API layer copies staged outputs back
        # into non-contiguous tensors here, and wait() must not return before that.
        for callback in callbacks:
            try:
                callback(self)
            except BaseException as exc:  # a broken callback must not leave waiters hanging
                logger.exception("%s: a completion callback raised", self.op_name)
                if self._exception is None:
                    self._exception = exc
                    self._state = WorkState.FAILED
        with self._lock:
            future = self._future
        if future is None:
            self._done.set()
        else:
            # As in PyTorch, the future completes (its callbacks run) before wait()
            # returns: a callback that issues an op issues it before the waiter's next
            # one, on every rank. The future's callbacks are the user's, so they run
            # where they may wait on other ops (``after_release``).
            after_release(self._settle)

    def _settle(self) -> None:
        """Complete the future (running its callbacks), then wake the waiters."""
        self._settling = threading.get_ident()
        try:
            _resolve_future(self)
        finally:
            self._settling = None
            self._done.set()

    def _on_done(self, callback: Callable[["Work"], None]) -> None:
        """Run ``callback(self)`` once the Work leaves PENDING (at once if it has)."""
        with self._lock:
            if self._state is WorkState.PENDING:
                self._callbacks.append(callback)
                return
        callback(self)

    # -- the public API ------------------------------------------------------------
    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block until the op finishes; re-raise its error. Returns True.

        ``timeout`` (a timedelta or seconds; None or 0 means no limit beyond the
        group's own) raises ``DistBackendError`` if the op is still running then.
        """
        # A finished op (the usual case for a synchronous call) returns before any clock
        # read or Event lock: a microsecond of a 10 us all-reduce.
        if self._done.is_set():
            if self._exception is not None:
                raise self._exception
            return True
        if self._settling == threading.get_ident():
            # A future callback waiting on its own op: the op is done, the waiters are not
            # woken yet because this very callback runs first.
            return self._wait_result()
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        return self._wait_until(seconds, time.monotonic() + seconds if seconds else None)

    def _wait_until(self, seconds: float | None, until: float | None) -> bool:
        """``wait`` with its limit as a ``time.monotonic()`` value (None: no limit)."""
        if not self._done.is_set() and not self._done.wait(None if until is None else
                                                           max(until - time.monotonic(), 0.0)):
            raise DistBackendError(
                f"Work.wait: {self.op_name} did not complete within {seconds:.3f}s; the operation "
                "is still in flight. Wait longer, or check that every rank called it."
            )
        return self._wait_result()

    def _wait_result(self) -> bool:
        if self._exception is not None:
            raise self._exception
        return True

    def is_completed(self) -> bool:
        return self._done.is_set() or self._settling == threading.get_ident()

    def is_success(self) -> bool:
        """No error so far (PyTorch's meaning: a pending op counts as successful)."""
        return self._exception is None

    def exception(self) -> BaseException | None:
        return self._exception

    def result(self) -> list[torch.Tensor]:
        """The output tensors of a finished op (failed or not); PyTorch does not wait here."""
        if not self._done.is_set():
            raise RuntimeError(f"{self.op_name}: Work needs to be completed before calling result(); wait() first")
        return self._outputs

    def source_rank(self) -> int:
        """For a receive: the rank that sent the message (-1 until it arrived)."""
        if self._sender_rank < 0 and self.op_name != "recv":
            raise RuntimeError(f"{self.op_name}: source_rank() may only be called on the Work of a recv")
        return self._sender_rank

    def _source_rank(self) -> int:
        """PyTorch's older, private name of ``source_rank()``."""
        return self.source_rank()

    def _get_op_type(self) -> str:
        return self.op_name

    def synchronize(self) -> None:
        """CPU ops have no device stream: same as wait()."""
        self.wait()

    def block_current_stream(self) -> None:
        self.wait()

    def get_future_result(self) -> torch.futures.Future:
        raise RuntimeError(f"{self.op_name}: get_future_result() is not implemented by the CPU backends (nor by "
                           "PyTorch's gloo); use get_future(), or wait() and exception()")

    def _get_duration(self) -> float:
        raise RuntimeError(f"{self.op_name}: the CPU backends do not time their ops (nor does PyTorch's gloo)")

    def get_future(self) -> torch.futures.Future:
        """A ``torch.futures.Future`` completed with the output tensors (or the error)."""
        with self._lock:
            if self._future is not None:
                return self._future
            self._future = torch.futures.Future()
            pending = self._state is WorkState.PENDING
        if not pending:  # (pending: _run_callbacks completes it)
            self._done.wait()  # the op's own completion callbacks have run
            _resolve_future(self)
        return self._future

    def __repr__(self) -> str:
        return f"Work({self.op_name}, {self._state.value})"


class _CompletedWork(Work):
    """A Work born COMPLETED: its state lives in the class, shared by all of its kind.

    ``Work()`` costs ~6 us (an Event, a Lock, the completion under the lock), a third
    of a small shared-memory all-reduce; this costs ~0.3 us. A completed Work never
    waits and holds its lock only to read its state, so one set Event and one lock
    serve them all, and it never gets a callback to keep."""

    _state = WorkState.COMPLETED
    _exception = None
    _sender_rank = -1
    _done = threading.Event()
    _done.set()
    _lock = threading.Lock()
    _future = None
    _settling = None
    _callbacks = ()

    def __init__(self, op_name: str, outputs: list[torch.Tensor] | None = None) -> None:
        self.op_name = op_name
        self._outputs = outputs if outputs is not None else []


def settle_future_callbacks(timeout: float) -> bool:
    """Wait up to ``timeout`` s until no Work's future callback is running; True if so
    (see ``thread_roles.settle_callbacks``: the interpreter's exit needs it)."""
    return settle_callbacks(timeout)


def _resolve_future(work: Work) -> None:
    future = work._future
    if future is None or future.done():
        return
    if work._exception is not None:
        future.set_exception(work._exception)
    else:
        future.set_result(work._outputs)

