"""Which thread plays which part for the progress engine, and where user callbacks run.

A thread is an engine's *worker* (it runs ops that callers issued and went on
from) or a caller; while it runs ops it *drives* an engine (``hold``/``let_go``,
nested when a composite backend's op drives its subgroups' engines). Code that an
op's completion triggers for the user, a ``torch.futures.Future``'s callbacks, runs
where it may issue and wait on further ops (``after_release``): after the caller
lets go of the engine, or on a callback thread when the worker completed the op.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Callable

__all__ = ["on_worker_thread", "become_worker", "after_release", "settle_callbacks", "driving", "hold", "let_go"]

logger = logging.getLogger(__name__)


class _ThreadRole(threading.local):
    """Per thread: is it an engine's worker, how many engines does it drive (nested),
    and what waits until it lets go of the outermost one. Class attributes are each
    thread's defaults, so reading them costs no ``getattr`` with a default."""

    worker = False
    depth = 0
    held: list[Callable[[], None]] | None = None


_thread_role = _ThreadRole()


def become_worker() -> None:
    """The calling thread is an engine's worker from now on."""
    _thread_role.worker = True


def on_worker_thread() -> bool:
    """Whether the calling thread is an engine's worker, i.e. runs ops that some
    caller issued and went on from (it is computing, or waits on a Work)."""
    return _thread_role.worker


def after_release(fn: Callable[[], None]) -> None:
    """Call ``fn()`` where it may block on other ops.

    For user code that an op's completion triggers (a ``torch.futures.Future``'s
    callbacks): such code may issue and wait on another op, as callbacks written for
    PyTorch do. That op could never run while this thread holds the engine, so on a
    thread driving an engine ``fn`` waits until it lets go; and on an engine's worker,
    which may be the only thread able to run that op, ``fn`` goes to a callback thread
    (gloo has a pool of worker threads for the same reason)."""
    role = _thread_role
    if role.worker:
        _CALLBACK_THREADS.run(fn)
    elif not role.depth:
        _call(fn)
    elif role.held is None:
        role.held = [fn]
    else:
        role.held.append(fn)


def _call(fn: Callable[[], None]) -> None:
    try:
        fn()
    except BaseException:  # noqa: BLE001 - user callbacks must not break the engine
        logger.exception("a callback run after an op completed raised")


class _CallbackThreads:
    """Daemon threads that run callbacks, one more whenever none is idle: a callback
    that blocks (on an op whose completion runs another callback) never holds up the
    others. Daemons, unlike ``ThreadPoolExecutor``'s, never keep a process from exiting."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """No threads and no tasks (also a forked child's state: it has none of the
        parent's threads, and its copy of the lock may be held)."""
        self._tasks: deque[Callable[[], None]] = deque()
        self._cv = threading.Condition()
        self._idle = 0
        self._running = 0

    def run(self, fn: Callable[[], None]) -> None:
        with self._cv:
            self._tasks.append(fn)
            if self._idle:
                self._cv.notify()
                return
        threading.Thread(target=self._loop, name="torchdist-callbacks", daemon=True).start()

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._idle += 1
                while not self._tasks:
                    if not self._cv.wait(timeout=_CALLBACK_IDLE_S):
                        self._idle -= 1
                        return
                self._idle -= 1
                fn = self._tasks.popleft()
                self._running += 1
            try:
                _call(fn)
            finally:
                with self._cv:
                    self._running -= 1
                    self._cv.notify_all()

    def settle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until no callback runs or waits to run; True if so."""
        end = time.monotonic() + timeout
        with self._cv:
            while self._tasks or self._running:
                remaining = end - time.monotonic()
                if remaining <= 0:
                    return False
                self._cv.wait(remaining)
        return True


#: How long an idle callback thread waits for more work before it exits.
_CALLBACK_IDLE_S = 10.0
_CALLBACK_THREADS = _CallbackThreads()
os.register_at_fork(after_in_child=_CALLBACK_THREADS.reset)


def driving() -> bool:
    """Whether the calling thread drives an engine now."""
    return _thread_role.depth > 0


def settle_callbacks(timeout: float) -> bool:
    """Wait until no callback thread runs a callback (at interpreter exit: a daemon
    thread still inside torch code while the interpreter finalizes aborts the process;
    a callback may finish only just after the future its caller waited on)."""
    return _CALLBACK_THREADS.settle(timeout)


def hold() -> None:
    """This thread starts driving an engine (possibly inside driving another)."""
    _thread_role.depth += 1


def let_go() -> None:
    """This thread stopped driving an engine: run what waited for the outermost one."""
    role = _thread_role
    role.depth -= 1
    if not role.depth and role.held is not None:
        held, role.held = role.held, None
        for fn in held:
            _call(fn)
