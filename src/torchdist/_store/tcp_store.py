"""TCPStore: the store every rank reaches over TCP; the master also runs the server.

One rank (``is_master=True``) starts a :class:`~torchdist._store.tcp_server.TCPServer`
in its process; every rank, the master included, holds a client connection to it.
The protocol is in :mod:`torchdist._store.wire`'s docstring.

Keys: a user key ``k`` is stored as ``"/k"``, as in PyTorch, so that internal keys
(``"init/"``, the join counter) cannot collide with user keys. ``list_keys`` shows
user keys only; ``num_keys`` counts the table, so a store built with a world size
reports one more key than the user set, exactly like ``torch.distributed.TCPStore``.

Timeouts without threads or polls: the client socket is *blocking* and the store
timeout is set once as the kernel's ``SO_RCVTIMEO``/``SO_SNDTIMEO``, so each request
costs one ``sendall`` and one ``recv`` (a Python-level socket timeout would add a
``poll`` per call). A ``recv`` that runs out of time raises ``EAGAIN``: for a
waiting request (``get``, ``wait``, ``multi_get``, blocking ``queue_pop``) that means
the keys did not come, and the client cancels the wait as the protocol describes;
for any other request it means the server stopped answering. The kernel rounds
these timeouts up to its timer tick (a few milliseconds), which a store's waits,
measured in seconds, can afford.

OS errors become :class:`~torchdist.errors.DistNetworkError` here, in
:meth:`_Connection._fail`, and nowhere else. After one the connection is closed
for good (its stream position is unknown) and every later call says so.

Layout: :class:`_Connection` (one socket: requests, replies, cancelling a wait),
then connecting (resolve, connect, handshake, with retries), then the public
:class:`TCPStore`. They are one module (~530 lines) because the connection exists
only for the store and its error handling is the store's contract.
"""

from __future__ import annotations

import logging
import random
import socket
import struct
import sys
import threading
import time
import weakref
from datetime import timedelta
from typing import Sequence

from .._auth import AuthenticationError, ClientHandshake, resolve_secret
from ..errors import DistNetworkError, DistStoreError, QueueEmptyError
from . import wire
from .base import (DEFAULT_STORE_TIMEOUT, Store, as_timedelta, key_list, key_str, key_value_lists, to_bytes,
                   wait_timeout_error)
from .table import int64_amount
from .tcp_server import TCPServer, acquire_server, release_server, retain_server
from .wire import HEADER, HEADER_I64, HEADER_U8, I64, U32, Op, Status

__all__ = ["TCPStore"]

log = logging.getLogger(__name__)

_INIT_KEY = b"init/"  # the join counter; outside the "/" namespace of user keys
_RECV_SIZE = 64 * 1024
_KEY_LENGTHS = struct.Struct("<II")
_CANCEL = wire.frame(Op.CANCEL)
_NUM_KEYS = wire.frame(Op.NUM_KEYS)
_LIST_KEYS = wire.frame(Op.LIST_KEYS)


def _key(key: str | bytes) -> bytes:
    return ("/" + key_str(key)).encode()


def _timeval(seconds: float) -> bytes:
    """``struct timeval`` for SO_RCVTIMEO (a DWORD of milliseconds on Windows)."""
    if sys.platform == "win32":
        return struct.pack("I", max(1, int(seconds * 1000)))
    seconds = max(seconds, 0.001)  # 0 would mean "no timeout"
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1_000_000))


class _Connection:
    """One socket to the server with its reply buffer; a lock serializes the threads using it."""

    def __init__(self, host: str, port: int, timeout: float, secret: bytes | None) -> None:
        self.where = f"{host}:{port}"
        self.lock = threading.Lock()
        self.sock: socket.socket | None = _connect(host, port, timeout, secret)
        self.broken = ""  # why the connection is unusable, once it is
        self.rbuf = bytearray()  # reply bytes beyond the last whole frame (only after a CANCEL)
        self.scratch = bytearray(_RECV_SIZE)
        self.view = memoryview(self.scratch)
        self.timeout = timeout  # the store timeout, seconds; may change from any thread
        self.read_timeout = -1.0  # what SO_RCVTIMEO holds now
        self.set_timeout(timeout)

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            self.broken = self.broken or "the store was closed"
            sock.close()

    def set_timeout(self, seconds: float, *, send: bool = True) -> None:
        """Bound blocking socket calls by ``seconds`` (the kernel enforces it); hold the lock."""
        value = _timeval(seconds)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        if send:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
        self.read_timeout = seconds

    # -- requests --------------------------------------------------------------------
    def send(self, frame: bytes) -> None:
        """A one-way request (SET, APPEND, QUEUE_PUSH, MULTI_SET)."""
        with self.lock:
            if self.sock is None:
                self._unusable()
            try:
                if self.read_timeout != self.timeout:  # set_timeout() was called
                    self.set_timeout(self.timeout)
                self.sock.sendall(frame)
            except OSError as exc:
                self._fail(exc, "sending a request")

    def call(self, frame: bytes) -> tuple[int, bytes]:
        """A request answered at once: one ``sendall``, usually one ``recv``."""
        with self.lock:
            if self.sock is None:
                self._unusable()
            try:
                if self.read_timeout != self.timeout:  # set_timeout() was called
                    self.set_timeout(self.timeout)
                self.sock.sendall(frame)
                status, body = self._read_reply()
                if status >= Status.ERROR:
                    self._raise_status(status, body)
            except OSError as exc:
                self._fail(exc, "waiting for a reply")
        return status, body

    def wait_call(self, frame: bytes, timeout: timedelta, keys: Sequence[str]) -> tuple[int, bytes]:
        """A request the server may hold until ``keys`` exist; cancelled after ``timeout``."""
        seconds = timeout.total_seconds()
        with self.lock:
            if self.sock is None:
                self._unusable()
            store_timeout = self.timeout
            try:
                if self.read_timeout != store_timeout:  # set_timeout() was called
                    self.set_timeout(store_timeout)
                self.sock.sendall(frame)
                if seconds != store_timeout:
                    self.set_timeout(seconds, send=False)
                try:
                    reply = self._read_reply()
                except BlockingIOError:  # SO_RCVTIMEO expired: the keys did not come
                    reply = self._cancel(max(store_timeout, seconds))
                    if reply is not None:
                        log.debug("TCPStore: the reply for %s crossed the CANCEL; using it", list(keys))
                if reply is not None and reply[0] >= Status.ERROR:
                    self._raise_status(*reply)
            except OSError as exc:
                self._fail(exc, "waiting for keys")
            finally:
                if self.sock is not None and self.read_timeout != store_timeout:
                    self.set_timeout(store_timeout, send=False)
        if reply is None:
            raise wait_timeout_error("TCPStore", keys, timeout)
        return reply

    def _cancel(self, ack_timeout: float) -> tuple[int, bytes] | None:
        """Withdraw the request in flight; returns its reply if that crossed the CANCEL.

        The server answers CANCEL with CANCELLED. If the keys arrived as we gave up,
        the real reply precedes the CANCELLED: it is the result (a popped queue value
        must not be dropped). Reading up to the CANCELLED puts the stream back in step.
        """
        self.sock.sendall(_CANCEL)
        self.set_timeout(ack_timeout, send=False)
        late = None
        while True:
            reply = self._read_reply()
            if reply[0] == Status.CANCELLED:
                return late
            late = reply

    def _read_reply(self) -> tuple[int, bytes]:
        """One reply frame, as (status, body); keeps any bytes beyond it for the next."""
        buf = self.rbuf
        if not buf:  # fast path: the whole reply in one recv, one copy of the body
            n = self.sock.recv_into(self.scratch)
            if n >= 5:
                length, status = HEADER.unpack_from(self.scratch)
                if n == length + 4:
                    return status, bytes(self.view[5:n])
            if n == 0:
                raise ConnectionResetError("the server closed the connection")
            buf += self.view[:n]
        while True:
            if len(buf) >= 5:
                length, status = HEADER.unpack_from(buf)
                if not 0 < length <= wire.MAX_FRAME:
                    raise ConnectionError(f"the server sent a frame of length {length}: not a torchdist store")
                if len(buf) >= length + 4:
                    body = bytes(buf[5 : length + 4])
                    del buf[: length + 4]
                    return status, body
            n = self.sock.recv_into(self.scratch)
            if n == 0:
                raise ConnectionResetError("the server closed the connection")
            buf += self.view[:n]

    # -- failures --------------------------------------------------------------------
    def _raise_status(self, status: int, body: bytes):
        """ERROR: the request failed (ValueError). UNAUTHENTICATED: the server hung up on us."""
        message = body.decode("utf-8", "replace")
        if status == Status.UNAUTHENTICATED:
            self.broken = f"the TCPStore server at {self.where} refused this process: {message}"
            self.close()
            raise AuthenticationError(self.broken)
        raise ValueError(message)

    def _fail(self, exc: OSError, doing: str):
        """The one place where OS errors become DistNetworkError; the connection is dropped."""
        if isinstance(exc, BlockingIOError):
            what = f"the server did not answer within the store timeout ({self.read_timeout:g} s)"
        else:
            what = f"{type(exc).__name__}: {exc}"
        self.broken = f"{doing} from the TCPStore server at {self.where} failed: {what}"
        self.close()
        raise DistNetworkError(
            f"{self.broken}. The server (the master rank's process) has likely exited or "
            "crashed; check its logs. This store handle is now unusable."
        ) from exc

    def _unusable(self):
        raise DistNetworkError(
            f"TCPStore connection to {self.where} is unusable: {self.broken}. Create a new TCPStore."
        )


def _connect(host: str, port: int, timeout: float, secret: bytes | None) -> socket.socket:
    """Connect and handshake, retrying with backoff until ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    delay, last = 0.01, None
    while True:
        if deadline - time.monotonic() <= 0:
            break
        sock = None
        try:
            sock = _open(host, port, deadline)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _handshake(sock, host, port, secret)
            sock.settimeout(None)  # blocking; _Connection bounds it with SO_RCVTIMEO
            return sock
        except OSError as exc:  # refused, reset, unresolvable, timed out: retry
            last = exc
            if sock is not None:
                sock.close()
        except DistNetworkError:
            sock.close()
            raise
        time.sleep(max(0.0, min(delay * random.uniform(0.5, 1.0), deadline - time.monotonic())))
        delay = min(delay * 2, 1.0)
    raise DistNetworkError(
        f"The client socket has timed out after {int(timeout * 1000)}ms while trying to connect "
        f"to ({host}, {port}); last error: {last}. Check that the master TCPStore "
        f"(is_master=True) is running and that {host}:{port} (MASTER_ADDR:MASTER_PORT) "
        "reaches it, or raise the timeout."
    ) from last


def _open(host: str, port: int, deadline: float) -> socket.socket:
    """A socket connected to the first reachable address of ``host``, by ``deadline``."""
    last: OSError = OSError(f"{host!r} resolved to no address")
    for family, kind, proto, _, address in _resolve(host, port, deadline - time.monotonic()):
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.connect(address)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
    raise last


def _resolve(host: str, port: int, timeout: float) -> list:
    """``getaddrinfo`` bounded by ``timeout``.

    ``getaddrinfo`` has no timeout of its own and an unreachable DNS server stalls it
    for seconds per try, so a host name (not a numeric address) is resolved on a
    helper thread that is abandoned, not waited for, when time runs out.
    """
    numeric = socket.AI_NUMERICHOST
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=numeric)
    except socket.gaierror:
        pass  # a name, not an address
    outcome: list = []

    def resolve() -> None:
        try:
            outcome.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=resolve, name=f"torchdist-resolve-{host}", daemon=True)
    thread.start()
    thread.join(max(timeout, 0.0))
    if not outcome:
        raise TimeoutError(f"resolving {host!r} took longer than {timeout:.2f} s")
    if isinstance(outcome[0], OSError):
        raise outcome[0]
    return outcome[0]


#: How long a server may take to answer the first handshake frame (s).
_HANDSHAKE_S = 10.0


def _handshake(sock: socket.socket, host: str, port: int, secret: bytes | None) -> None:
    """HELLO (magic, version, nonce); then, holding a secret, AUTH twice (see wire).

    Raises DistNetworkError (AuthenticationError about the secret) when the peer is
    not a torchdist store this process may use: retrying would not help. A
    connection closed before the first reply byte raises OSError, which is retried.
    """
    where = f"the TCPStore server at {host}:{port}"
    hello = wire.HELLO_BODY.pack(wire.MAGIC, wire.VERSION, random.getrandbits(64))
    sock.sendall(wire.frame(Op.HELLO, hello))
    # A torchdist server answers at once; another server may wait forever for a request
    # it understands (torchrun's own store, which a torchdist program run by torchrun
    # finds at MASTER_PORT): give up then, naming that.
    sock.settimeout(min(sock.gettimeout() or _HANDSHAKE_S, _HANDSHAKE_S))
    try:
        status, body = _handshake_reply(sock, where, first=True)
    except TimeoutError:
        raise DistNetworkError(
            f"{where} accepted the connection but did not answer torchdist's handshake within "
            f"{_HANDSHAKE_S:.0f} s: it is not a torchdist TCPStore server. Under torchrun, MASTER_PORT is torchrun's "
            "own store (PyTorch's protocol): launch torchdist programs with torchdist-run. Otherwise check "
            "MASTER_ADDR/MASTER_PORT."
        ) from None
    if status != Status.OK or body != hello:
        said = body.decode("utf-8", "replace") if status == Status.ERROR else f"status {status}, {body[:32]!r}"
        raise DistNetworkError(
            f"{where} answered the handshake with {said}: it is not a torchdist TCPStore server of "
            f"protocol version {wire.VERSION}. Check MASTER_PORT, and that every rank runs the same "
            "torchdist version."
        )
    if secret is None:
        return
    auth = ClientHandshake(secret)
    sock.sendall(wire.frame(Op.AUTH, auth.hello()))
    status, challenge = _handshake_reply(sock, where)
    if status == Status.OK:
        sock.sendall(wire.frame(Op.AUTH, auth.answer(challenge, where)))  # raises if its proof is wrong
        status, body = _handshake_reply(sock, where)
        if status == Status.OK:
            return
    else:
        body = challenge
    raise AuthenticationError(f"{where} refused this process: {body.decode('utf-8', 'replace')}")


def _handshake_reply(sock: socket.socket, where: str, first: bool = False) -> tuple[int, bytes]:
    """One small frame; anything else is not a torchdist store talking."""
    data = b""
    while len(data) < 4 or len(data) < 4 + U32.unpack_from(data)[0]:
        if len(data) >= 4 and not 0 < U32.unpack_from(data)[0] <= wire.HANDSHAKE_MAX:
            break
        chunk = sock.recv(wire.HANDSHAKE_MAX)
        if not chunk:
            if first and not data:  # e.g. a server shutting down: worth a retry
                raise ConnectionResetError(f"{where} closed the connection during the handshake")
            break
        data += chunk
    if len(data) < 5 or len(data) != 4 + U32.unpack_from(data)[0]:
        raise DistNetworkError(
            f"{where} answered the handshake with {data[:64]!r}: it is not a torchdist TCPStore server. "
            "Check MASTER_ADDR/MASTER_PORT."
        )
    return data[4], data[5:]


class TCPStore(Store):
    """A key-value store served over TCP by the master rank, with PyTorch's signature.

    ``world_size``: when given (and ``wait_for_workers``), every store bumps a join
    counter and the master blocks until ``world_size`` stores joined.
    ``multi_tenant``: masters in one process asking for the same port share a server.
    ``master_listen_fd``: a socket already bound to ``port`` for the server to listen on.
    ``use_libuv`` is accepted and ignored (``libuvBackend`` is always False).
    ``secret`` (torchdist only; default ``$TORCHDIST_SECRET``): the job secret every
    connection must prove it holds (see :mod:`torchdist._auth`); server and clients
    must agree on whether there is one.
    """

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: timedelta = DEFAULT_STORE_TIMEOUT,
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: int | None = None,
        use_libuv: bool = True,
        *,
        secret: str | bytes | None = None,
    ) -> None:
        super().__init__(as_timedelta(timeout))
        if world_size == 0:
            raise ValueError("TCPStore world size cannot be 0")
        if world_size is not None and world_size < 0:
            world_size = None  # PyTorch treats a negative world size as unknown
        if not 0 <= port <= 65535:
            raise ValueError(f"TCPStore port must be in 0..65535, got {port}")
        self.host = host_name
        self.port = port
        self.libuvBackend = False
        self._world_size = world_size
        self._secret = resolve_secret(secret)
        self._server: TCPServer | None = None
        self._finalizers: list[weakref.finalize] = []
        if is_master:
            self._server = acquire_server(
                port, multi_tenant=multi_tenant, listen_fd=master_listen_fd, secret=self._secret
            )
            self.port = self._server.port
            self._finalizers.append(weakref.finalize(self, release_server, self._server))
        elif port == 0:
            raise ValueError("a TCPStore client needs the master's port; port=0 is for is_master=True")
        try:
            self._conn = _Connection(host_name, self.port, self._timeout.total_seconds(), self._secret)
        except BaseException:
            self.close()
            raise
        self._finalizers.append(weakref.finalize(self, self._conn.close))
        if world_size is not None and wait_for_workers:
            self._join(is_master)

    def _join(self, is_master: bool) -> None:
        """Count this store in; the master waits for all, polling like PyTorch (10 ms)."""
        joined = self._add_raw(_INIT_KEY, 1)
        start = time.monotonic()
        while is_master and joined < self._world_size:
            elapsed = time.monotonic() - start
            if elapsed > self._timeout.total_seconds():
                self.close()
                raise DistStoreError(
                    f"Timed out after {elapsed:.0f} seconds waiting for clients. "
                    f"{joined}/{self._world_size} clients joined."
                )
            time.sleep(0.01)
            joined = self._add_raw(_INIT_KEY, 0)

    def close(self, drain: float = 0.0) -> None:
        """Close the connection; the last store using a server stops it.

        ``drain`` (torchdist only): before stopping its server, a master waits up to
        this many seconds for the other processes' clients to disconnect.
        """
        if self._server is not None:
            self._server.drain = max(self._server.drain, drain)
        for finalizer in reversed(self._finalizers):
            finalizer()

    def __repr__(self) -> str:
        role = "master" if self._server is not None else "client"
        return f"TCPStore({self.host}:{self.port}, {role})"

    def set_timeout(self, timeout: timedelta) -> None:
        """Takes effect at the next request; one in flight keeps the timeout it started with."""
        super().set_timeout(timeout)
        self._conn.timeout = self._timeout.total_seconds()

    def clone(self) -> "TCPStore":
        """A new connection to the same server, e.g. for another thread; it keeps the server alive."""
        other = TCPStore(
            self.host, self.port, None, False, self._timeout, wait_for_workers=False, secret=self._secret
        )
        other._world_size = self._world_size
        if self._server is not None:
            retain_server(self._server)
            other._server = self._server
            other._finalizers.insert(0, weakref.finalize(other, release_server, self._server))
        return other

    # -- the core operations ----------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self._conn.send(wire.key_value(Op.SET, _key(key), to_bytes(value)))

    def get(self, key: str) -> bytes:
        kb = _key(key)
        return self._conn.wait_call(HEADER.pack(len(kb) + 1, Op.GET) + kb, self._timeout, (key,))[1]

    def add(self, key: str, amount: int) -> int:
        return self._add_raw(_key(key), int64_amount(amount))

    def _add_raw(self, kb: bytes, amount: int) -> int:
        body = self._conn.call(HEADER_I64.pack(len(kb) + 9, Op.ADD, amount) + kb)[1]
        return I64.unpack(body)[0]

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        kb, eb, db = _key(key), to_bytes(expected), to_bytes(desired)
        body = _KEY_LENGTHS.pack(len(kb), len(eb)) + kb + eb + db
        return self._conn.call(wire.frame(Op.COMPARE_SET, body))[1]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        keys = key_list(keys)
        timeout = self._timeout if timeout is None else as_timedelta(timeout)
        frame = wire.frame(Op.WAIT, wire.pack_strings([_key(k) for k in keys]))
        self._conn.wait_call(frame, timeout, keys)

    def check(self, keys: list[str]) -> bool:
        keys = key_list(keys)
        frame = wire.frame(Op.CHECK, wire.pack_strings([_key(k) for k in keys]))
        return self._conn.call(frame)[1] == b"\x01"

    def delete_key(self, key: str) -> bool:
        return self._conn.call(wire.frame(Op.DELETE_KEY, _key(key)))[1] == b"\x01"

    def num_keys(self) -> int:
        """Keys in the server's table, the join counter included (as in PyTorch)."""
        return I64.unpack(self._conn.call(_NUM_KEYS)[1])[0]

    # -- the extended API -------------------------------------------------------------
    def has_extended_api(self) -> bool:
        return True

    def append(self, key: str, value: str | bytes) -> None:
        self._conn.send(wire.key_value(Op.APPEND, _key(key), to_bytes(value)))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        keys = key_list(keys)
        frame = wire.frame(Op.MULTI_GET, wire.pack_strings([_key(k) for k in keys]))
        body = self._conn.wait_call(frame, self._timeout, keys)[1]
        return wire.unpack_strings(body, 0, len(body))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        keys, values = key_value_lists(keys, values)
        flat = [item for k, v in zip(keys, values) for item in (_key(k), v)]
        self._conn.send(wire.frame(Op.MULTI_SET, wire.pack_strings(flat)))

    def list_keys(self) -> list[str]:
        """User keys only: internal keys (the join counter) are hidden, as in PyTorch."""
        body = self._conn.call(_LIST_KEYS)[1]
        keys = (k.decode() for k in wire.unpack_strings(body, 0, len(body)))
        return [k[1:] for k in keys if k.startswith("/")]

    def queue_push(self, key: str, value: str | bytes) -> None:
        self._conn.send(wire.key_value(Op.QUEUE_PUSH, _key(key), to_bytes(value)))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        kb = _key(key)
        frame = HEADER_U8.pack(len(kb) + 2, Op.QUEUE_POP, 1 if block else 0) + kb
        if block:
            return self._conn.wait_call(frame, self._timeout, (key,))[1]
        status, body = self._conn.call(frame)
        if status == Status.EMPTY:
            raise QueueEmptyError(f"queue_pop: queue {key!r} is empty (block=False)")
        return body

    def queue_len(self, key: str) -> int:
        return I64.unpack(self._conn.call(wire.frame(Op.QUEUE_LEN, _key(key)))[1])[0]
