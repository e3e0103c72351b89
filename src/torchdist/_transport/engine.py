"""The progress engine: runs a group's ops in issue order over its transport.

Exactly one thread *drives* the transport at a time (``busy``). Ops are queued in
issue order (the order every rank issues them), and run by whichever thread gets
there first:

- the *caller*: ``Work.wait()`` on an op that is next in line while nobody drives
  runs it right there (``run_now``). A synchronous op is submitted and waited on
  at once, so it normally runs on the caller's thread with no hand-off (a thread
  wake-up costs 30-300 us on the 2-core VM we measured, more than a small op);
- the *worker*: a daemon thread, woken on submit, runs whatever is still queued,
  so an ``async_op=True`` op proceeds while the caller computes. When the queue
  is empty but transfers are still pending (an ``irecv`` waiting for its
  message, an ``isend`` larger than the socket buffers) the worker keeps
  driving the transport, in short ``progress`` calls that a new submit
  interrupts.

Point-to-point ops do not queue behind collectives (``post``): a send may be what
a peer needs before it can join the collective issued before it, as in gloo,
which posts sends and receives at once. A post runs at once on the calling
thread if nobody drives the transport; otherwise the driver runs it at its next
poll (``Transport.on_poll``), even in the middle of a collective.

States of the engine::

    idle ──submit──▶ queued ──run by caller or worker──▶ busy ──queue empty──▶ idle
      └──────────────────────────── close() ─────────────────────────▶ closed

Lock: ``_cv`` (its lock, ``_mutex``) guards ``_queue``, ``_busy`` and ``_closed``
(``settle`` waits on it for the driver to let go);
it is never held while an op runs or the transport is driven. ``_posts`` is a
deque: appended by any thread, emptied only by the driver.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

from .base import Transport
from .thread_roles import become_worker, driving, hold, let_go

__all__ = ["Engine", "EngineOp"]

logger = logging.getLogger(__name__)

#: How long the worker blocks in one ``progress`` call while transfers are pending.
_IDLE_POLL_S = 0.05


class EngineOp:
    """One queued op: ``execute()`` runs it (it completes or fails its own Work);
    ``abandon(exc)`` fails it without running (engine closed or group broken)."""

    __slots__ = ("execute", "abandon", "started")

    def __init__(self, execute: Callable[[], None], abandon: Callable[[BaseException], None]) -> None:
        self.execute = execute
        self.abandon = abandon
        self.started = False


class Engine:
    """Queue of a group's ops plus the worker that runs them when callers don't."""

    def __init__(self, transport: Transport, name: str,
                 idle_step: Callable[[], None] | None = None) -> None:
        """``idle_step()`` is what the worker calls while only transfers are pending
        (default: ``transport.progress`` for a short while); the owner uses it to
        enforce deadlines of posted point-to-point ops."""
        self.transport = transport
        self.name = name
        self._idle_step = idle_step or (lambda: transport.progress(_IDLE_POLL_S))
        # ``_cv``'s lock, also taken bare where nobody waits or is notified: entering a
        # Condition runs Python code, a bare lock does not (take/release cost 0.8 us that way).
        self._mutex = threading.Lock()
        self._cv = threading.Condition(self._mutex)
        self._queue: deque[EngineOp] = deque()
        self._posts: deque[EngineOp] = deque()  # handed to the driver by ``post``
        self._busy = False
        self._moving_only = False  # the driver only moves P2P transfers (no op runs)
        self._closed = False
        self._watchers = 0  # threads in ``settle``, to be notified when the driver lets go
        self._worker: threading.Thread | None = None

    def submit(self, op: EngineOp, wake: bool) -> None:
        """Queue ``op``. ``wake``: start it on the worker now (large ops, so they overlap
        with the caller's compute). Small ops on an idle engine are left for the
        caller's ``wait`` (``run_now``), or a ``kick``: a wake-up would cost more
        than the op and make the caller fight the worker for the GIL."""
        with self._cv:
            if self._closed:
                raise RuntimeError(f"{self.name}: the engine is closed")
            idle = not self._busy and not self._queue
            self._queue.append(op)
            if wake or not idle:
                self._wake_worker()
            driving = self._busy
        if driving:  # the worker may be blocked in progress() on pending transfers
            self.transport.interrupt()

    def post(self, op: EngineOp, caller_waits: bool) -> None:
        """Run ``op`` (it posts transfers) now on this thread if nobody drives the
        transport, whatever is queued; else hand it to the driver, which runs it at
        its next poll or when it lets go of the transport.

        ``caller_waits``: the caller waits on the op next and drives its transfers
        itself (a blocking send or recv), so they do not wake the worker: a hand-off
        to it and back costs two thread wake-ups (measured on shared memory: 8-byte
        ping-pong 65 us one way that way, 32 us without; benchmarks/bench_p2p.py)."""
        with self._mutex:
            if self._closed:
                raise RuntimeError(f"{self.name}: the engine is closed")
            driving = self._busy
            if driving:
                self._posts.append(op)
                # After the append: a driver that clears the hook (_run_posts) before
                # draining either sees this op or is called again.
                self.transport.on_poll = self._run_posts
            else:
                self._busy = True
        if driving:
            self.transport.interrupt()  # the driver may be blocked in a poll
            return
        hold()
        op.started = True
        try:
            self._execute(op)
        finally:
            self.release(leave_pending=caller_waits)

    def _run_posts(self) -> None:
        """On the driving thread: run the ops that ``post`` handed over."""
        self.transport.on_poll = None  # before draining (see post)
        posts = self._posts
        while True:
            try:
                op = posts.popleft()
            except IndexError:  # empty (close() may empty it from another thread)
                return
            op.started = True
            self._execute(op)

    def queued(self) -> bool:
        """Whether ops wait in the queue (read without the lock: a hint for a driver)."""
        return bool(self._queue)

    def kick(self) -> None:
        """Make sure queued ops and pending transfers progress without the caller
        (``is_completed`` polling, futures, a caller that cannot drive)."""
        with self._cv:
            if self._has_work() and not self._closed:
                self._wake_worker()

    def _wake_worker(self) -> None:  # under _cv
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name=f"torchdist-{self.name}", daemon=True)
            self._worker.start()
        self._cv.notify()

    def run_now(self, op: EngineOp) -> bool:
        """Run queued ops on this thread, in order, up to and including ``op``.

        False if another thread drives the transport (the caller then waits for
        the worker) or ``op`` is not queued any more."""
        with self._cv:
            if self._busy or op not in self._queue:
                return False
            self._busy = True
        hold()
        try:
            while True:
                with self._cv:
                    head = self._queue.popleft() if self._queue else None
                    if head is not None:
                        head.started = True
                if head is None:
                    return op.started
                self._execute(head)
                if head is op:
                    return True
        finally:
            self.release()

    def take(self) -> bool:
        """Take the transport for this thread if the engine is idle (nothing queued,
        nobody driving); False if not. Every True is paired with ``release()``."""
        with self._mutex:
            if self._busy or self._queue or self._closed:
                return False
            self._busy = True
        hold()
        return True

    def drive(self, until: Callable[[], bool], step: Callable[[], None]) -> bool:
        """Take the transport and call ``step()`` until ``until()``; False if busy."""
        if not self.take():
            return False
        self._moving_only = True
        try:
            while not until():
                step()
        finally:
            self.release()
        return True

    def _execute(self, op: EngineOp) -> None:
        try:
            op.execute()
        except BaseException:  # execute fails its own Work; this is a bug guard
            logger.exception("%s: op raised out of the engine", self.name)

    def _run(self, op: EngineOp) -> None:
        try:
            self._execute(op)
        finally:
            self.release()

    def release(self, leave_pending: bool = False) -> None:
        """Give the transport back (after ``take`` or a run); the worker takes over
        leftovers, except pending transfers with ``leave_pending`` (the caller drives them)."""
        if self._posts:
            self._run_posts()
        with self._mutex:
            self._busy = self._moving_only = False
            leftovers = self._queue or self._posts or (not leave_pending and self._has_work())
            if leftovers and not self._closed:
                # leftovers (async ops, posts handed over since the drain above, pending
                # transfers): the worker takes over
                self._wake_worker()
            if self._watchers:
                self._cv.notify_all()
        let_go()

    def _work(self) -> None:
        become_worker()
        while True:
            with self._cv:
                while not self._closed and (self._busy or not self._has_work()):
                    self._cv.wait()
                if self._closed:
                    return
                op = self._queue.popleft() if self._queue else None
                if op is not None:
                    op.started = True
                self._busy = True
                self._moving_only = op is None
            hold()
            if op is not None:
                self._run(op)
                continue
            try:
                if self._posts:
                    self._run_posts()
                self._idle_step()
            except BaseException:  # noqa: BLE001 - errors surface through the transfers
                logger.debug("%s: progress failed", self.name, exc_info=True)
            finally:
                self.release()

    def _has_work(self) -> bool:  # under _mutex
        return bool(self._queue or self._posts) or (self.transport.error is None and self.transport.pending())

    def settle(self, timeout: float, transfers_count: bool = False) -> bool:
        """Wait up to ``timeout`` s until no op is queued or running (the worker runs the
        queued ones); with ``transfers_count``, until no thread drives the transport at
        all. True if so. A thread that drives an engine itself would wait for itself:
        it only learns whether the engine is settled now."""
        def settled() -> bool:
            return not self._queue and not (self._busy and (transfers_count or not self._moving_only))
        if driving():
            with self._mutex:
                return settled()
        end = time.monotonic() + timeout
        with self._cv:
            self._watchers += 1
            try:
                while not settled():
                    if self._queue and not self._closed:
                        self._wake_worker()
                    remaining = end - time.monotonic()
                    if remaining <= 0:
                        return False
                    self._cv.wait(remaining)
                return True
            finally:
                self._watchers -= 1

    def close(self, error: BaseException) -> None:
        """Fail queued ops with ``error`` and stop the worker."""
        with self._cv:
            self._closed = True
            queued = self._take_all()
            self._cv.notify_all()
            worker = self._worker
        for op in queued:
            op.abandon(error)
        self.transport.interrupt()
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout=2.0)

    def fail_queued(self, error: BaseException) -> None:
        """The group broke: ops still queued will never run."""
        with self._cv:
            queued = self._take_all()
        for op in queued:
            op.abandon(error)

    def _take_all(self) -> list[EngineOp]:  # under _mutex
        ops = list(self._queue) + list(self._posts)
        self._queue.clear()
        self._posts.clear()
        self.transport.on_poll = None
        return ops
