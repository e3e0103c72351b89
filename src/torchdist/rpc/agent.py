"""The RPC agent: one connection per pair of workers (TCP, or a Unix socket on the same host), requests multiplexed.

Threads of one worker::

    caller threads ──call()──► pickle, register a Pending, send_frame ─► socket
                                                      (per-connection send lock)
    reader thread (one per peer at a time) ◄── socket
        REQUEST  ──► served inline on the reader (a handler slot free), else on the
                     thread pool (num_worker_threads) ──► handler ──► RESPONSE/ERROR
        RESPONSE ──► unpickle, complete the caller's Future (on the reader thread)
        ERROR    ──► rebuild the remote exception, fail the Future
        GOODBYE  ──► the peer is closing: its EOF is expected
    timer thread: one heap of deadlines for all pending calls; while requests are
        served inline it also ticks every _STALL_S / 2 and gives a connection whose
        reader has been serving one request for _STALL_S a new reader thread

Inline serving saves a thread wake-up on the critical path of every call (the
round trip went from four hand-offs to three). A request that blocks -- sleeps,
computes for long, waits for another message from the same peer -- costs its
peer at most ~_STALL_S of stalled reading, then runs on like a pool thread.
At most ``num_worker_threads`` requests run inline at once; beyond that they queue
on the pool as before.

Locks and ordering:

- ``_lock`` guards the pending table and the connection states. A pending call is
  completed by whoever *removes* it from the table (response, timeout, peer lost),
  so a Future is never completed twice;
- each connection has a send lock: frames must not interleave on the wire. A large
  frame holds it while the kernel drains it, which is what we want (TCP is one
  ordered stream anyway);
- Futures are completed on the reader thread, so their callbacks run there and must
  not block on another RPC to the same peer (the reader is the only thread that
  could deliver its answer). Internal callbacks only send.

A peer whose connection breaks without a GOODBYE is *lost*: every pending call to
it fails at once with :class:`~torchdist.errors.DistNetworkError` naming it, and
later calls to it fail immediately. OS errors become DistNetworkError here.

Large buffers to a same-host peer travel as memfd segments (see
:mod:`~torchdist.rpc.same_host`); ``_send`` makes them outside the send lock.

Calls to self skip the network but not pickling: arguments are copied, as they are
for a remote worker, and run on the same thread pool.

Membership: the agent knows the workers of the group (``workers``, itself included)
and has one connection per other worker. A static world gives them all to the
constructor; a dynamic world (:mod:`~torchdist.rpc.membership`) adds a worker with
``add_peer`` when it joins and removes it with ``remove_peer`` when it says it
leaves. A removed worker's connection stays until its GOODBYE and EOF.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from ..errors import DistNetworkError
from . import same_host
from .options import WorkerInfo
from .serialization import pack_exception, unpack_exception
from .wire import Frame, FrameKind, FrameReader, send_frame

__all__ = ["TcpAgent", "Codec", "Outgoing", "timeout_error", "unknown_destination"]

logger = logging.getLogger(__name__)

_SOCKET_BUFFER = 4 << 20
_AF_UNIX = getattr(socket, "AF_UNIX", None)
# A request served on a reader thread that runs longer than this gets its connection a new
# reader (see TcpAgent._serve_inline). Long enough for builtins and small functions, short
# enough that a handler waiting on its own peer costs a few ms once, not a deadlock.
_STALL_S = 0.004


def timeout_error(timeout: float) -> RuntimeError:
    """PyTorch's message for a call that ran past its timeout."""
    return RuntimeError(f"RPCErr:1:RPC ran for more than set timeout ({int(timeout * 1000)} ms) and will now be "
                        "marked with an error")


def unknown_destination(me: WorkerInfo, kind: str, value: object) -> RuntimeError:
    """PyTorch's message for a destination that is not (or no longer) in the group."""
    return RuntimeError(f"name:{me.name},rank:{me.id} could not find destination {kind} {value}")


@dataclass
class Outgoing:
    """A message ready to send: pickle payload, out-of-band buffers and autograd ids."""

    payload: bytes
    buffers: list[memoryview]
    keep_alive: Any = None  # tensors whose memory the buffers point into
    context_id: int = -1
    send_id: int = -1


class Codec(Protocol):
    """Turns objects into :class:`Outgoing` messages and frames back into objects.

    Implemented by :mod:`torchdist.rpc.dispatch` (which adds RRef forks and
    distributed autograd); the agent only moves frames.
    """

    def encode(self, obj: Any, dst: int, context_id: int) -> Outgoing: ...

    def decode(self, frame: Frame, src: int) -> Any: ...


class _Pending:
    __slots__ = ("future", "dst", "timeout")

    def __init__(self, future: torch.futures.Future, dst: int, timeout: float) -> None:
        self.future, self.dst, self.timeout = future, dst, timeout


class _Connection:
    __slots__ = ("peer", "sock", "send_lock", "frames", "reader", "inline_since", "alive", "goodbye", "error")

    def __init__(self, peer: WorkerInfo, sock: socket.socket) -> None:
        self.peer = peer
        self.sock = sock
        self.send_lock = threading.Lock()
        self.frames: FrameReader | None = None  # read by the one thread in ``reader``
        self.reader: threading.Thread | None = None  # the thread reading this connection now
        self.inline_since = 0.0  # when ``reader`` began serving a request inline; 0 = it reads
        self.alive = True
        self.goodbye = False  # the peer said it is closing
        self.error: DistNetworkError | None = None


class TcpAgent:
    """Moves requests and responses; ``handler(src, obj, frame)`` serves requests on the pool.

    The handler returns the response object, or a ``torch.futures.Future`` whose
    value is sent when it completes (``@async_execution``); an exception it raises
    is sent back as an ERROR frame.
    """

    def __init__(self, me: WorkerInfo, workers: dict[int, WorkerInfo], sockets: dict[int, socket.socket],
                 num_threads: int, codec: Codec, handler: Callable[[int, Any, Frame], Any]) -> None:
        self.me = me
        self.workers = dict(workers)  # the group now, this worker included (guarded by _lock)
        self._by_name = {w.name: w for w in self.workers.values()}
        self.codec = codec
        self.handler = handler
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._idle = threading.Condition(self._lock)  # notified when _pending or _serving drops to 0
        self._serving = 0  # requests received and not yet answered (answers may wait on a Future)
        self._deadlines: list[tuple[float, int]] = []
        self._timer_wake = threading.Condition(self._lock)
        self._timer_ticking = False  # the timer thread wakes every _STALL_S to watch inline handlers
        self._closing = False
        self._num_threads = num_threads
        self._inline = 0  # requests being served on reader threads
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix=f"rpc-{me.name}")
        self._conns = {peer: _Connection(workers[peer], sock) for peer, sock in sockets.items()}
        #: Called as ``on_lost(peer, error)`` once a peer is lost (on its reader thread).
        self.on_lost: Callable[[WorkerInfo, DistNetworkError], None] | None = None
        self._timer = threading.Thread(target=self._timeout_loop, daemon=True, name=f"rpc-timeouts-{me.name}")

    def start(self) -> None:
        """Start the reader threads (after everything a handler needs is in place)."""
        for conn in self._conns.values():
            self._open(conn)
        self._timer.start()

    def _open(self, conn: _Connection) -> None:
        conn.sock.setblocking(True)
        # Larger kernel buffers: fewer wake-ups per large tensor (measured: 64 MiB args +~20%).
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
        conn.frames = FrameReader(conn.sock)
        self._start_reader(conn)

    # -- membership ------------------------------------------------------------------
    def add_peer(self, peer: WorkerInfo, sock: socket.socket, greeting: bytes = b"") -> None:
        """A worker joined: start serving its connection.

        ``greeting`` is sent first, before any frame can be (the send lock is held
        until the worker is known): the joiner's cue that it may send requests.
        """
        conn = _Connection(peer, sock)
        with conn.send_lock:
            with self._lock:
                if self._closing:
                    sock.close()
                    raise RuntimeError(f"RPC agent of {self.me.name} is shutting down: {peer} cannot join")
                self._conns[peer.id] = conn
                self.workers[peer.id] = peer
                self._by_name[peer.name] = peer
            if greeting:
                sock.sendall(greeting)
            self._open(conn)

    def remove_peer(self, peer_id: int) -> None:
        """A worker said it leaves: it is no destination any more (its connection ends with its GOODBYE)."""
        with self._lock:
            peer = self.workers.pop(peer_id, None)
            if peer is not None and self._by_name.get(peer.name) is peer:
                del self._by_name[peer.name]

    def get_worker_info(self, to: str | int) -> WorkerInfo:
        """The member named ``to`` (or with id ``to``); PyTorch's RuntimeError if there is none now."""
        with self._lock:
            info = self._by_name.get(to) if isinstance(to, str) else self.workers.get(to)
        if info is None:
            raise unknown_destination(self.me, "name" if isinstance(to, str) else "id", to)
        return info

    def get_worker_infos(self) -> list[WorkerInfo]:
        """The workers of the group now, this one included, by id."""
        with self._lock:
            return sorted(self.workers.values(), key=lambda w: w.id)

    def _start_reader(self, conn: _Connection) -> None:
        conn.reader = threading.Thread(target=self._read_loop, args=(conn,), daemon=True,
                                       name=f"rpc-reader-{self.me.name}<-{conn.peer.name}")
        conn.reader.start()

    # -- calling ---------------------------------------------------------------------
    def call(self, dst: int, obj: Any, timeout: float, context_id: int = -1) -> torch.futures.Future:
        """Send ``obj`` as a request to worker ``dst``; the Future gets the decoded response.

        ``timeout`` in seconds, 0 = none. Pickling errors raise here, in the caller.
        """
        future: torch.futures.Future = torch.futures.Future()
        out = self.codec.encode(obj, dst, context_id)
        request_id = next(self._ids)
        with self._lock:
            self._pending[request_id] = _Pending(future, dst, timeout)
            if timeout != 0:  # 0: none; a negative one is already past
                deadline = time.monotonic() + timeout
                first = not self._deadlines or deadline < self._deadlines[0][0]
                heapq.heappush(self._deadlines, (deadline, request_id))
                if first:
                    self._timer_wake.notify()
        if dst == self.me.id:
            frame = _loopback_frame(FrameKind.REQUEST, request_id, out)
            self._pool.submit(self._serve, self.me.id, frame)
            return future
        with self._lock:
            conn = self._conns.get(dst)
        if conn is None:
            self._complete(request_id, error=unknown_destination(self.me, "id", dst))
            return future
        try:
            self._send(conn, FrameKind.REQUEST, request_id, out)
        except DistNetworkError as exc:
            self._complete(request_id, error=exc)
        return future

    def _send(self, conn: _Connection, kind: FrameKind, request_id: int, out: Outgoing) -> None:
        if not conn.alive:
            raise conn.error or self._lost_error(conn.peer)
        segments: dict[int, int] = {}
        try:
            if conn.sock.family == _AF_UNIX:  # same host: large buffers as memfd segments
                for i, buf in enumerate(out.buffers):
                    if buf.nbytes >= same_host.SEGMENT_MIN_BYTES and len(segments) < same_host.MAX_FDS:
                        segments[i] = same_host.make_segment(buf)  # the copy, outside the send lock
            with conn.send_lock:
                send_frame(conn.sock, kind, request_id, out.payload, out.buffers, out.context_id, out.send_id,
                           segments)
        except OSError as exc:
            self._lose(conn, exc)
            raise (conn.error or self._lost_error(conn.peer)) from exc
        finally:
            for fd in segments.values():
                os.close(fd)

    def _complete(self, request_id: int, value: Any = None, error: BaseException | None = None) -> None:
        with self._lock:
            pending = self._pending.pop(request_id, None)
            if not self._pending:
                self._idle.notify_all()
        if pending is None:
            return  # timed out or failed already; a late answer is dropped
        if error is not None:
            pending.future.set_exception(error)
        else:
            pending.future.set_result(value)

    # -- serving ---------------------------------------------------------------------
    def _serve(self, src: int, frame: Frame) -> None:
        """Run one request on the pool and answer it (now, or when its Future completes)."""
        with self._lock:
            self._serving += 1
        try:
            obj = self.codec.decode(frame, src)
            result = self.handler(src, obj, frame)
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            self._respond_error(src, frame, exc)
            return
        if isinstance(result, torch._C.Future):
            result.add_done_callback(lambda fut: self._respond_future(src, frame, fut))
        else:
            self._respond(src, frame, result)

    def _respond_future(self, src: int, frame: Frame, fut: torch.futures.Future) -> None:
        try:
            value = fut.wait()
        except BaseException as exc:  # noqa: BLE001
            self._respond_error(src, frame, exc)
            return
        self._respond(src, frame, value)

    def _respond(self, src: int, frame: Frame, value: Any) -> None:
        try:
            out = self.codec.encode(value, src, frame.context_id)
        except BaseException as exc:  # noqa: BLE001 - e.g. an unpicklable return value
            self._respond_error(src, frame, exc)
            return
        self._answer(src, FrameKind.RESPONSE, frame.request_id, out)

    def _respond_error(self, src: int, frame: Frame, exc: BaseException) -> None:
        logger.debug("%s: request %d from %d raised %r", self.me.name, frame.request_id, src, exc)
        self._answer(src, FrameKind.ERROR, frame.request_id, Outgoing(pack_exception(exc, repr(self.me)), []))

    def _answer(self, src: int, kind: FrameKind, request_id: int, out: Outgoing) -> None:
        try:
            if src == self.me.id:
                self._on_answer(_loopback_frame(kind, request_id, out), src)
            else:
                self._send(self._conns[src], kind, request_id, out)
        except DistNetworkError as exc:
            # The caller gave up (timeout) and shut down, or died: nobody waits for this answer.
            conn = self._conns[src]
            level = logging.INFO if conn.goodbye else logging.WARNING
            logger.log(level, "%s: could not answer request %d of %s: %s", self.me.name, request_id,
                       conn.peer.name, exc)
        finally:
            with self._lock:
                self._serving -= 1
                if not self._serving:
                    self._idle.notify_all()

    def _on_answer(self, frame: Frame, src: int) -> None:
        if frame.kind is FrameKind.ERROR:
            self._complete(frame.request_id, error=unpack_exception(frame.payload))
            return
        with self._lock:
            known = frame.request_id in self._pending
        if not known:
            return
        try:
            value = self.codec.decode(frame, src)
        except BaseException as exc:  # noqa: BLE001 - e.g. the response names an unknown class
            self._complete(frame.request_id, error=exc)
            return
        self._complete(frame.request_id, value)

    # -- the reader thread -----------------------------------------------------------
    def _read_loop(self, conn: _Connection) -> None:
        """Read frames until the connection ends, or until a watchdog hand-over (see ``_serve_inline``)."""
        while True:
            try:
                frame = conn.frames.read_frame()
            except (OSError, EOFError, ValueError) as exc:
                if self._closing:
                    conn.alive = False
                elif conn.goodbye:  # the peer left (and the group goes on): close our side, so it sees EOF
                    with self._lock:
                        conn.alive = False
                        conn.error = self._lost_error(conn.peer)
                        unanswered = [rid for rid, p in self._pending.items() if p.dst == conn.peer.id]
                    with conn.send_lock:
                        conn.sock.close()
                    conn.frames.close()
                    for request_id in unanswered:
                        self._complete(request_id, error=conn.error)
                else:
                    self._lose(conn, exc)
                return
            if frame.kind is FrameKind.REQUEST:
                if self._try_inline(conn):
                    if not self._serve_inline(conn, frame):
                        return  # another thread reads this connection now
                    continue
                try:
                    self._pool.submit(self._serve, conn.peer.id, frame)
                except RuntimeError:  # the pool was shut down: we are closing
                    return
            elif frame.kind is FrameKind.GOODBYE:
                conn.goodbye = True
            else:
                self._on_answer(frame, conn.peer.id)

    def _lost_error(self, peer: WorkerInfo) -> DistNetworkError:
        name = peer.name
        return DistNetworkError(f"RPC agent of {self.me.name}: the connection to {name} is closed: {name} "
                                f"shut down or died. See its log for the cause.")

    def _lose(self, conn: _Connection, exc: BaseException) -> None:
        """The peer went away without a GOODBYE: fail every call waiting on it."""
        with self._lock:
            if not conn.alive:
                return
            conn.alive = False
            name = conn.peer.name
            conn.error = DistNetworkError(f"RPC agent of {self.me.name} lost {name}: {exc or 'connection closed'}."
                                          f" {name} most likely died; see its log for the cause.")
            if isinstance(exc, OSError):
                conn.error.__cause__ = exc
            lost = [rid for rid, p in self._pending.items() if p.dst == conn.peer.id]
        logger.warning("%s", conn.error)
        for request_id in lost:
            self._complete(request_id, error=conn.error)
        if self.on_lost is not None:
            self.on_lost(conn.peer, conn.error)

    # -- inline serving ----------------------------------------------------------------
    def _try_inline(self, conn: _Connection) -> bool:
        """Claim a handler slot for serving on this reader thread (False: use the pool)."""
        with self._lock:
            if self._inline >= self._num_threads or self._closing:
                return False
            self._inline += 1
            conn.inline_since = time.monotonic()
            if not self._timer_ticking:
                self._timer_ticking = True
                self._timer_wake.notify()
            return True

    def _serve_inline(self, conn: _Connection, frame: Frame) -> bool:
        """Serve ``frame`` on the reader thread; False if meanwhile a new reader took over.

        Most requests (builtins, small user functions, the RRef protocol) finish in
        microseconds, and handing them to the pool costs a thread wake-up (30-300 us on a
        loaded VM) on the critical path of every call. A request that runs longer than
        ``_STALL_S`` -- it sleeps, computes, or waits for another message from this very
        peer -- is noticed by the timer thread, which starts a new reader for the
        connection; this thread finishes the request as a pool thread would and exits.
        """
        me = threading.current_thread()
        try:
            self._serve(conn.peer.id, frame)
        finally:
            with self._lock:
                self._inline -= 1
                if conn.reader is me:
                    conn.inline_since = 0.0
                    return True
        return False

    def _hand_over_stalled(self, now: float) -> None:
        """(timer thread, lock held) Give each connection whose reader serves a slow request a new reader."""
        for conn in self._conns.values():
            if conn.inline_since and now - conn.inline_since >= _STALL_S and conn.alive:
                conn.inline_since = 0.0
                logger.debug("%s: a request from %s runs longer than %.0f ms: new reader", self.me.name,
                             conn.peer.name, _STALL_S * 1e3)
                self._start_reader(conn)

    # -- timeouts --------------------------------------------------------------------
    def _timeout_loop(self) -> None:
        with self._lock:
            while not self._closing:
                now = time.monotonic()
                if self._timer_ticking:
                    self._hand_over_stalled(now)
                    # Keep ticking while inline handlers run; sleep until the next deadline after.
                    self._timer_ticking = self._inline > 0
                expired = []
                while self._deadlines and self._deadlines[0][0] <= now:
                    _, request_id = heapq.heappop(self._deadlines)
                    if request_id in self._pending:
                        expired.append(request_id)
                if expired:
                    self._lock.release()  # complete outside the lock: callbacks may call()
                    try:
                        for request_id in expired:
                            pending = self._pending.get(request_id)
                            if pending is not None:
                                self._complete(request_id, error=timeout_error(pending.timeout))
                    finally:
                        self._lock.acquire()
                    continue
                wait = self._deadlines[0][0] - now if self._deadlines else None
                if self._timer_ticking:
                    wait = _STALL_S / 2 if wait is None else min(wait, _STALL_S / 2)
                self._timer_wake.wait(wait)

    # -- shutdown --------------------------------------------------------------------
    def wait_idle(self, timeout: float | None) -> bool:
        """Block until no call of this worker is pending; False at the timeout."""
        with self._lock:
            return self._idle.wait_for(lambda: not self._pending, timeout)

    def close(self, graceful: bool, timeout: float = 10.0) -> None:
        """Say GOODBYE, close the connections, fail what is still pending, stop the threads.

        Graceful: first let every request being served send its answer (up to
        ``timeout`` s): a peer may be waiting for it, e.g. for the shutdown barrier.
        """
        with self._lock:
            if graceful and not self._idle.wait_for(lambda: not self._serving, timeout):
                logger.warning("%s: closing with %d requests still being served", self.me.name, self._serving)
            self._closing = True
            self._timer_wake.notify()
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            if graceful and conn.alive:
                try:
                    with conn.send_lock:
                        send_frame(conn.sock, FrameKind.GOODBYE, 0, b"")
                    conn.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
        deadline = time.monotonic() + (2.0 if graceful else 0.0)
        for conn in conns:
            if graceful and conn.reader is not None:
                conn.reader.join(max(0.0, deadline - time.monotonic()))  # until the peer's EOF
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.sock.close()
            if conn.frames is not None and (conn.reader is None or not conn.reader.is_alive()):
                conn.frames.close()  # segments that arrived for frames nobody will read
        with self._lock:
            left = list(self._pending)
        for request_id in left:
            self._complete(request_id, error=RuntimeError(f"RPC agent of {self.me.name} shut down before the "
                                                          "call completed"))
        self._pool.shutdown(wait=graceful, cancel_futures=not graceful)
        self._timer.join(1.0)


def _loopback_frame(kind: FrameKind, request_id: int, out: Outgoing) -> Frame:
    """What the wire would deliver for ``out``, without the wire (calls to self)."""
    buffers = [torch.frombuffer(bytearray(buf), dtype=torch.uint8) if buf.nbytes else
               torch.empty(0, dtype=torch.uint8) for buf in out.buffers]
    return Frame(kind, request_id, out.context_id, out.send_id, out.payload, buffers)
