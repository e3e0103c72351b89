"""The TCPStore server: one thread, one selector, every socket non-blocking.

The master :class:`~torchdist._store.tcp_store.TCPStore` starts a :class:`TCPServer`
in its process. The server keeps its data in a
:class:`~torchdist._store.table.KeyValueTable` (so HashStore and TCPStore share
every semantic) and speaks the protocol of :mod:`torchdist._store.wire`.

Why one thread and no blocking anywhere: a thread per client would cost 1024
threads for 1024 ranks, and a blocking ``get`` would pin one. Instead a request
that must wait registers a *waiter* under a missing key; every write to the table
reports the key to :meth:`TCPServer._on_change`, and after each event the loop
retries the waiters of the changed keys. Only the server thread touches the table,
the waiters and the connections, so none of them needs a lock.

Robustness: a peer that breaks the protocol (bad handshake, unknown op, a length
over :data:`~torchdist._store.wire.MAX_FRAME`, a malformed body, a request while
it waits) is logged and disconnected; every other failure in a handler is caught
the same way, so no peer can stop the loop. A peer that does not read its replies
stops being read until they drain, which bounds what it can make the server buffer.
Requests still arriving are buffered up to :data:`_PARTIAL_BUDGET` for all clients
together (one frame may be 64 MiB; many clients each sending part of one would
otherwise hold gigabytes): the client whose bytes would pass it is disconnected.
A connection that has not finished the handshake :data:`_HANDSHAKE_S` after it was
accepted is dropped, so silent peers (a port scan, a hung client) cannot pile up
descriptors; a client past the handshake may stay idle as long as it likes.

Servers are shared in-process through a small registry (:func:`acquire_server`,
:func:`release_server`): ``multi_tenant`` stores asking for the same port share one
server, reference counted, and the last release stops it. The registry is keyed by
port alone because the server listens on every local address, as PyTorch's does.

Connections start with the handshake of the wire protocol (HELLO, then AUTH when
the server holds the job secret): until it is over a connection is not ``ready``
and nothing reaches the table.

The module is longer than most (~600 lines) because the loop, the handshake, the
waiters and the handlers share one connection state; split apart, that state would
become an interface between modules for no reader's benefit.
"""

from __future__ import annotations

import errno
import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections import deque

from .._auth import AuthenticationError, ServerHandshake
from ..errors import DistNetworkError
from . import wire
from .table import KeyValueTable
from .wire import HEADER, HEADER_I64, HEADER_U8, I64, U32, Op, Status

__all__ = ["TCPServer", "acquire_server", "release_server"]

log = logging.getLogger(__name__)

_RECV_SIZE = 256 * 1024
#: Bytes of incomplete requests the server holds for all clients together (8 x MAX_FRAME).
_PARTIAL_BUDGET = 512 * 1024 * 1024
_BACKLOG = 4096  # the kernel caps it at net.core.somaxconn
_WAKE = object()  # selector data of the socket that interrupts select() on stop()
_KEY_LENGTHS = struct.Struct("<II")  # COMPARE_SET: key and expected lengths
#: Seconds a connection may take to finish the handshake (HELLO, AUTH) after accept.
_HANDSHAKE_S = 60.0

_OK = HEADER.pack(1, Status.OK)
_CANCELLED = HEADER.pack(1, Status.CANCELLED)
_EMPTY = HEADER.pack(1, Status.EMPTY)
_TRUE = HEADER_U8.pack(2, Status.OK, 1)
_FALSE = HEADER_U8.pack(2, Status.OK, 0)


class _ProtocolError(Exception):
    """A peer broke the protocol; it is disconnected, and the server carries on."""


def _ok(body: bytes) -> bytes:
    if len(body) >= wire.MAX_FRAME:
        return _error(str(wire.too_large(len(body) + 1)))
    return HEADER.pack(len(body) + 1, Status.OK) + body


def _error(message: str, status: int = Status.ERROR) -> bytes:
    body = message.encode("utf-8", "replace")
    return HEADER.pack(len(body) + 1, status) + body


def _unauthenticated(message: str) -> bytes:
    return _error(message, Status.UNAUTHENTICATED)


# Handshake stages of a connection (see wire's docstring).
_HELLO, _NONCE, _PROOF, _READY = range(4)


class _Conn:
    """One client connection and its buffers; ``waiter`` is set while it WAITs."""

    __slots__ = ("sock", "peer", "inbuf", "counted", "outbuf", "ready", "stage", "auth", "waiter")

    def __init__(self, sock: socket.socket, peer: object) -> None:
        self.sock: socket.socket | None = sock  # None once closed
        self.peer = peer
        self.inbuf = bytearray()  # bytes received but not yet a whole frame
        self.counted = 0  # len(inbuf) as the server's total of partial bytes counts it
        self.outbuf = bytearray()  # reply bytes the socket did not take yet
        self.ready = False  # handshake over: stage == _READY, kept as a bool for the hot path
        self.stage = _HELLO
        self.auth: ServerHandshake | None = None
        self.waiter: _Waiter | None = None


class _Waiter:
    """A GET, WAIT, MULTI_GET or blocking QUEUE_POP parked under one missing key."""

    __slots__ = ("conn", "op", "keys", "parked_on")

    def __init__(self, conn: _Conn, op: int, keys: list[str]) -> None:
        self.conn = conn
        self.op = op
        self.keys = keys
        self.parked_on = ""


class TCPServer:
    """Serves one :class:`KeyValueTable` on ``port`` (0: a free one) from a daemon thread."""

    def __init__(self, port: int = 0, listen_fd: int | None = None, secret: bytes | None = None) -> None:
        _raise_fd_limit()
        self.secret = secret  # clients must prove they hold it (see torchdist._auth)
        self._listener = _listen(port, listen_fd)
        self.port: int = self._listener.getsockname()[1]
        self.refs = 1  # stores using this server; guarded by _registry_lock
        self._table = KeyValueTable(self._on_change)
        self._waiters: dict[str, dict[_Waiter, None]] = {}  # dict: ordered set, O(1) removal
        self._changed: list[str] = []
        self._conns: set[_Conn] = set()
        self._partial_bytes = 0  # the sum of the connections' len(inbuf): see _PARTIAL_BUDGET
        # Accepted connections still in the handshake, with their deadlines, oldest first
        # (every deadline is accept time + _HANDSHAKE_S, so the order is the deadlines').
        self._handshaking: deque[tuple[float, _Conn]] = deque()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = False
        self._closing = False  # draining before a stop: the listener closes
        #: Seconds stop() waits for clients to disconnect first (see TCPStore.close).
        self.drain = 0.0
        self._handlers: list = [None] * (max(Op) + 1)  # None: not a request once READY
        for op in Op:
            if op != Op.HELLO:
                self._handlers[op] = getattr(self, "_op_" + op.name.lower())
        self._thread = threading.Thread(
            target=self._run, name=f"torchdist-tcpstore-server:{self.port}", daemon=True
        )
        self._thread.start()

    @property
    def running(self) -> bool:
        return not self._stopping and self._thread.is_alive()

    def stop(self) -> None:
        """Close every connection and the listener; waits for the thread unless called on it.

        With ``drain`` set, first wait up to that many seconds for the clients to hang
        up: a rank that exits right after its last request would otherwise cut off
        peers still reading their replies (the init barrier's, typically).
        """
        if self.drain > 0 and threading.current_thread() is not self._thread:
            # No newcomers while draining: a process that re-initializes on this port
            # must reach the next server, not this one (which then stops under it). It
            # is refused and retries until the next server listens.
            self._closing = True
            self._wake()
            deadline = time.monotonic() + self.drain
            # _conns belongs to the server thread; its size is only read here.
            while self._conns and self._thread.is_alive() and time.monotonic() < deadline:
                time.sleep(0.005)
        self._stopping = True
        self._wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    # -- the event loop ------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except Exception:  # noqa: BLE001 - a bug in the loop itself; clients see EOF
            log.exception("TCPStore server on port %d failed; closing every connection", self.port)
        finally:
            self._stopping = True
            self._shutdown()

    def _loop(self) -> None:
        select = self._selector.select
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        log.debug("TCPStore server listening on port %d", self.port)
        while not self._stopping:
            timeout = None
            if self._handshaking:
                timeout = max(self._handshaking[0][0] - time.monotonic(), 0.0)
            for key, mask in select(timeout):
                conn = key.data
                try:
                    if conn is None:
                        if not self._closing:  # (the listener may have closed earlier in this batch)
                            self._accept()
                    elif conn is _WAKE:
                        self._wake_r.recv(64)
                        if self._closing and self._listener.fileno() >= 0:
                            self._selector.unregister(self._listener)
                            self._listener.close()
                    else:
                        if mask & selectors.EVENT_WRITE and conn.sock is not None:
                            self._on_writable(conn)
                        if mask & selectors.EVENT_READ and conn.sock is not None:
                            self._on_readable(conn)
                except Exception:  # noqa: BLE001 - no request may stop the loop
                    log.exception("TCPStore server: unexpected error on %r", getattr(conn, "peer", conn))
                    if isinstance(conn, _Conn):
                        self._close(conn)
                if self._changed:
                    self._wake_waiters()
            if self._handshaking:
                self._drop_silent()

    def _drop_silent(self) -> None:
        """Close connections whose handshake deadline passed; forget finished ones."""
        now, queue = time.monotonic(), self._handshaking
        while queue:
            deadline, conn = queue[0]
            if conn.sock is not None and not conn.ready:
                if deadline > now:
                    return
                log.warning("TCPStore server: dropping client %r: no handshake within %.0f s", conn.peer,
                            _HANDSHAKE_S)
                self._close(conn)
            queue.popleft()

    def _shutdown(self) -> None:
        for conn in list(self._conns):
            self._close(conn)
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
        self._selector.close()
        log.debug("TCPStore server on port %d stopped", self.port)

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.error("TCPStore server on port %d cannot accept: %s", self.port, exc)
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    time.sleep(0.01)  # out of descriptors: do not spin on the ready listener
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, peer)
            self._conns.add(conn)
            self._handshaking.append((time.monotonic() + _HANDSHAKE_S, conn))
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _close(self, conn: _Conn) -> None:
        if conn.sock is None:
            return
        if conn.waiter is not None:
            self._unpark(conn.waiter)
        self._selector.unregister(conn.sock)
        conn.sock.close()
        conn.sock = None
        self._conns.discard(conn)
        self._partial_bytes -= conn.counted
        conn.counted = 0
        conn.inbuf = bytearray()

    def _on_readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(_RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.debug("TCPStore client %r: %s", conn.peer, exc)
            self._close(conn)
            return
        if not data:  # orderly shutdown by the peer
            self._close(conn)
            return
        self._feed(conn, data)

    def _on_writable(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.outbuf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.debug("TCPStore client %r: %s", conn.peer, exc)
            self._close(conn)
            return
        del conn.outbuf[:sent]
        if not conn.outbuf:  # drained: read again, starting with what was held back
            self._selector.modify(conn.sock, selectors.EVENT_READ, conn)
            self._feed(conn, b"")

    def _send(self, conn: _Conn, data: bytes) -> None:
        if conn.outbuf:
            conn.outbuf += data
            return
        try:
            sent = conn.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            log.debug("TCPStore client %r: %s", conn.peer, exc)
            self._close(conn)
            return
        if sent < len(data):  # the peer is slow: stop reading it until this drains
            conn.outbuf += memoryview(data)[sent:]
            self._selector.modify(conn.sock, selectors.EVENT_WRITE, conn)

    # -- framing -------------------------------------------------------------------
    def _feed(self, conn: _Conn, data: bytes) -> None:
        """Handle every whole frame of ``conn.inbuf + data``; keep the rest buffered."""
        try:
            if conn.inbuf:  # slow path: a frame spans several reads
                conn.inbuf += data
                consumed = self._handle_frames(conn, conn.inbuf)
                del conn.inbuf[:consumed]
            elif data:  # fast path: no copy when the read holds whole frames
                consumed = self._handle_frames(conn, data)
                if consumed < len(data):
                    conn.inbuf += memoryview(data)[consumed:]
        except _ProtocolError as exc:
            log.warning("TCPStore server: dropping client %r: %s", conn.peer, exc)
            self._close(conn)
        except (ValueError, IndexError, UnicodeDecodeError, struct.error) as exc:
            log.warning("TCPStore server: dropping client %r: malformed request (%s)", conn.peer, exc)
            self._close(conn)
        if conn.sock is None or len(conn.inbuf) == conn.counted:
            return
        self._partial_bytes += len(conn.inbuf) - conn.counted
        conn.counted = len(conn.inbuf)
        if conn.inbuf and self._partial_bytes > _PARTIAL_BUDGET:
            log.warning("TCPStore server: dropping client %r: the incomplete requests of all clients would hold "
                        "%d MiB, over the server's %d MiB", conn.peer, self._partial_bytes >> 20,
                        _PARTIAL_BUDGET >> 20)
            self._close(conn)

    def _handle_frames(self, conn: _Conn, buf: bytes | bytearray) -> int:
        """Run the requests in ``buf``; returns how many bytes they took."""
        pos, size, handlers = 0, len(buf), self._handlers
        while size - pos >= 4 and not conn.outbuf and conn.sock is not None:
            (length,) = U32.unpack_from(buf, pos)
            if not conn.ready:  # judged on the 4 bytes of the length, before any body
                if conn.stage == _HELLO and length != wire.HELLO_FRAME_LEN:
                    raise _ProtocolError(f"expected a {wire.HELLO_FRAME_LEN}-byte HELLO, got length {length}")
                if length == 0 or length > wire.HANDSHAKE_MAX:
                    self._refuse(conn, f"a request of {length} bytes")
            elif length == 0 or length > wire.MAX_FRAME:
                raise _ProtocolError(f"frame length {length} outside 1..{wire.MAX_FRAME}")
            end = pos + 4 + length
            if end > size:
                break
            op = buf[pos + 4]
            if not conn.ready:
                reply = self._handshake(conn, op, bytes(buf[pos + 5 : end]))
            else:
                if conn.waiter is not None and op != Op.CANCEL:
                    raise _ProtocolError(f"request {op} sent while a wait is in flight")
                handler = handlers[op] if op < len(handlers) else None
                if handler is None:
                    raise _ProtocolError(f"unexpected message type {op}")
                reply = handler(conn, buf, pos + 5, end)
            if reply is not None:
                self._send(conn, reply)
            pos = end
        return pos

    def _handshake(self, conn: _Conn, op: int, body: bytes) -> bytes:
        """One step of HELLO, then (with a secret) two AUTH exchanges; see wire's docstring."""
        if conn.stage == _HELLO:
            if op != Op.HELLO:
                raise _ProtocolError(f"expected a HELLO, got message type {op}")
            magic, version, _ = wire.HELLO_BODY.unpack(body)
            if magic != wire.MAGIC:
                raise _ProtocolError(f"bad handshake magic {magic:#x}")
            if version != wire.VERSION:
                problem = f"protocol version {version} unsupported; this server speaks {wire.VERSION}"
                self._send(conn, _error(problem))
                raise _ProtocolError(problem)
            conn.stage = _NONCE if self.secret is not None else _READY
            conn.ready = conn.stage == _READY
            return _ok(body)
        if op != Op.AUTH:
            self._refuse(conn, f"message type {op}")
        if conn.stage == _NONCE:
            conn.auth = ServerHandshake(self.secret)
            try:
                challenge = conn.auth.challenge(body)
            except AuthenticationError as exc:
                raise _ProtocolError(str(exc)) from None
            conn.stage = _PROOF
            return _ok(challenge)
        if not conn.auth.verify(body):
            self._send(conn, _unauthenticated("authentication failed: the client does not hold this job's secret"))
            raise _ProtocolError("failed authentication (wrong job secret)")
        conn.stage, conn.ready, conn.auth = _READY, True, None
        return _OK

    def _refuse(self, conn: _Conn, what: str):
        """A request from a client that did not authenticate: say why, then drop it."""
        self._send(
            conn,
            _unauthenticated(
                "this TCPStore requires the job secret: set the same TORCHDIST_SECRET (or secret=) "
                "on every process of the job"
            ),
        )
        raise _ProtocolError(f"{what} before authenticating")

    def _op_auth(self, conn: _Conn, buf, pos: int, end: int) -> None:
        problem = (
            "this TCPStore has no job secret, but the client holds one: start the master with the "
            "same TORCHDIST_SECRET (or secret=), or unset it on the clients"
            if self.secret is None
            else "AUTH after the handshake"
        )
        self._send(conn, _unauthenticated(problem))
        raise _ProtocolError(problem)

    # -- waiters -------------------------------------------------------------------
    def _on_change(self, key: str) -> None:
        if key in self._waiters:
            self._changed.append(key)

    def _try(self, waiter: _Waiter) -> bytes | None:
        """The reply if ``waiter`` can be answered now; else park it on a missing key."""
        table, op, keys = self._table, waiter.op, waiter.keys
        missing = None
        if op == Op.GET or op == Op.QUEUE_POP:
            value = table.get(keys[0]) if op == Op.GET else table.queue_pop(keys[0])
            if value is not None:
                return _ok(value)
            missing = keys[0]
        elif op == Op.WAIT:
            missing = next((key for key in keys if not table.contains(key)), None)
            if missing is None:
                return _OK
        else:  # MULTI_GET
            values = [table.get(key) for key in keys]
            if None not in values:
                return _ok(wire.pack_strings(values))
            missing = keys[values.index(None)]
        self._waiters.setdefault(missing, {})[waiter] = None
        waiter.parked_on = missing
        waiter.conn.waiter = waiter
        return None

    def _unpark(self, waiter: _Waiter) -> None:
        parked = self._waiters.get(waiter.parked_on)
        if parked is not None:
            parked.pop(waiter, None)
            if not parked:
                del self._waiters[waiter.parked_on]
        waiter.conn.waiter = None

    def _wake_waiters(self) -> None:
        """Retry, in arrival order, the waiters of every key written since the last call."""
        changed = self._changed
        while changed:
            parked = self._waiters.pop(changed.pop(), None)
            for waiter in parked or ():
                if waiter.conn.sock is None:  # closed by a failed send earlier in this loop
                    continue
                waiter.conn.waiter = None
                reply = self._try(waiter)  # parks it again if still unanswerable
                if reply is not None:
                    self._send(waiter.conn, reply)

    def _wait_for(self, conn: _Conn, op: int, keys: list[str]) -> bytes | None:
        return self._try(_Waiter(conn, op, keys))

    # -- handlers: (conn, frame buffer, body start, body end) -> reply or None -----
    def _key_value(self, buf, pos: int, end: int) -> tuple[str, bytes]:
        (klen,) = U32.unpack_from(buf, pos)
        split = pos + 4 + klen
        if split > end:
            raise _ProtocolError("key runs past the end of its frame")
        value = buf[split:end]
        return buf[pos + 4 : split].decode(), value if type(value) is bytes else bytes(value)

    def _op_set(self, conn: _Conn, buf, pos: int, end: int) -> None:
        self._table.set(*self._key_value(buf, pos, end))

    def _op_append(self, conn: _Conn, buf, pos: int, end: int) -> None:
        self._table.append(*self._key_value(buf, pos, end))

    def _op_queue_push(self, conn: _Conn, buf, pos: int, end: int) -> None:
        self._table.queue_push(*self._key_value(buf, pos, end))

    def _op_multi_set(self, conn: _Conn, buf, pos: int, end: int) -> None:
        flat = wire.unpack_strings(buf, pos, end)  # parse all before applying any
        if len(flat) % 2:
            raise _ProtocolError("MULTI_SET with an odd number of strings")
        for i in range(0, len(flat), 2):
            self._table.set(flat[i].decode(), flat[i + 1])

    def _op_get(self, conn: _Conn, buf, pos: int, end: int) -> bytes | None:
        key = buf[pos:end].decode()
        value = self._table.get(key)  # inlined fast path of _try
        if value is not None:
            return _ok(value)
        return self._wait_for(conn, Op.GET, [key])

    def _op_wait(self, conn: _Conn, buf, pos: int, end: int) -> bytes | None:
        return self._wait_for(conn, Op.WAIT, [k.decode() for k in wire.unpack_strings(buf, pos, end)])

    def _op_multi_get(self, conn: _Conn, buf, pos: int, end: int) -> bytes | None:
        return self._wait_for(conn, Op.MULTI_GET, [k.decode() for k in wire.unpack_strings(buf, pos, end)])

    def _op_queue_pop(self, conn: _Conn, buf, pos: int, end: int) -> bytes | None:
        key = buf[pos + 1 : end].decode()
        if buf[pos]:
            return self._wait_for(conn, Op.QUEUE_POP, [key])
        value = self._table.queue_pop(key)
        return _EMPTY if value is None else _ok(value)

    def _op_add(self, conn: _Conn, buf, pos: int, end: int) -> bytes:
        (amount,) = I64.unpack_from(buf, pos)
        try:
            total = self._table.add(buf[pos + 8 : end].decode(), amount)
            return HEADER_I64.pack(9, Status.OK, total)
        except ValueError as exc:
            return _error(str(exc))

    def _op_compare_set(self, conn: _Conn, buf, pos: int, end: int) -> bytes:
        klen, elen = _KEY_LENGTHS.unpack_from(buf, pos)
        key_end = pos + 8 + klen
        if key_end + elen > end:
            raise _ProtocolError("COMPARE_SET fields run past the end of the frame")
        key = buf[pos + 8 : key_end].decode()
        expected, desired = bytes(buf[key_end : key_end + elen]), bytes(buf[key_end + elen : end])
        return _ok(self._table.compare_set(key, expected, desired))

    def _op_check(self, conn: _Conn, buf, pos: int, end: int) -> bytes:
        keys = wire.unpack_strings(buf, pos, end)
        return _TRUE if self._table.check(k.decode() for k in keys) else _FALSE

    def _op_delete_key(self, conn: _Conn, buf, pos: int, end: int) -> bytes:
        return _TRUE if self._table.delete(buf[pos:end].decode()) else _FALSE

    def _op_num_keys(self, conn: _Conn, buf, pos: int, end: int) -> bytes:
        return HEADER_I64.pack(9, Status.OK, self._table.num_keys())

    def _op_list_keys(self, conn: _Conn, buf, pos: int, end: int) -> bytes:
        return _ok(wire.pack_strings([key.encode() for key in self._table.list_keys()]))

    def _op_queue_len(self, conn: _Conn, buf, pos: int, end: int) -> bytes:
        return HEADER_I64.pack(9, Status.OK, self._table.queue_len(buf[pos:end].decode()))

    def _op_cancel(self, conn: _Conn, buf, pos: int, end: int) -> bytes:
        if conn.waiter is not None:  # still WAITING; otherwise the reply crossed the CANCEL
            self._unpark(conn.waiter)
        return _CANCELLED


# -- listening ---------------------------------------------------------------------
def _listen(port: int, listen_fd: int | None) -> socket.socket:
    """The listening socket, on every local address (IPv4 and IPv6 where possible)."""
    try:
        if listen_fd is not None:
            sock = socket.socket(fileno=os.dup(listen_fd))  # ours to close; the caller keeps its fd
            bound = sock.getsockname()[1]
            if port not in (0, bound):
                sock.close()
                raise ValueError(f"master_listen_fd is bound to port {bound}, but port={port} was given")
            sock.listen(_BACKLOG)
        elif socket.has_dualstack_ipv6():
            sock = socket.create_server(
                ("", port), family=socket.AF_INET6, backlog=_BACKLOG, dualstack_ipv6=True
            )
        else:
            sock = socket.create_server(("", port), backlog=_BACKLOG)
    except OSError as exc:
        raise DistNetworkError(
            "The server socket has failed to listen on any local network address. "
            f"port: {port}, error: {exc.strerror or exc}. Another process, or another "
            "TCPStore master in this one, may hold the port: choose another port, pass "
            "port=0 for a free one, or multi_tenant=True to share one server in-process."
        ) from exc
    sock.setblocking(False)
    return sock


def _raise_fd_limit() -> None:
    """Every client costs the server a descriptor; lift the soft limit to the hard one."""
    try:
        import resource
    except ImportError:  # not POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            log.debug("raised RLIMIT_NOFILE from %d to %d", soft, target)
        except (ValueError, OSError) as exc:
            log.debug("could not raise RLIMIT_NOFILE from %d: %s", soft, exc)


# -- the in-process registry -------------------------------------------------------
_registry_lock = threading.Lock()
_tenants: dict[int, TCPServer] = {}  # multi-tenant servers by port


def acquire_server(
    port: int, *, multi_tenant: bool = False, listen_fd: int | None = None, secret: bytes | None = None
) -> TCPServer:
    """A running server for ``port``: shared when ``multi_tenant``, else a new one."""
    with _registry_lock:
        if multi_tenant and port > 0:
            server = _tenants.get(port)
            if server is not None and server.running:
                if server.secret != secret:
                    raise ValueError(
                        f"a multi-tenant TCPStore server on port {port} already runs in this process "
                        "with a different job secret; stores that share a server share its secret"
                    )
                server.refs += 1
                return server
        server = TCPServer(port, listen_fd, secret)
        if multi_tenant:
            _tenants[server.port] = server
        return server


def retain_server(server: TCPServer) -> None:
    """One more store (a clone) keeps ``server`` alive."""
    with _registry_lock:
        server.refs += 1


def release_server(server: TCPServer) -> None:
    """One store stopped using ``server``; the last one stops it."""
    with _registry_lock:
        server.refs -= 1
        if server.refs > 0:
            return
        if _tenants.get(server.port) is server:
            del _tenants[server.port]
    server.stop()
