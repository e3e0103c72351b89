"""Bootstrap a full TCP mesh between the ranks of a group through its store.

Each rank listens on an ephemeral port and publishes ``host:port`` under the key
``tcp/addr/<rank>`` of the group's (already prefixed, so private) store. Rank ``r``
then connects to every lower rank and accepts one connection from every higher
rank. ``connect`` completes in the peer's listen backlog before it calls
``accept``, so the order cannot deadlock. The connecting side introduces itself
with a 16-byte hello (magic, rank) so the acceptor knows which rank each socket is.

OS errors become :class:`~torchdist.errors.DistNetworkError` here (with the OSError
as cause); a peer that never shows up raises at the deadline naming it.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import time

from ..errors import DistNetworkError

__all__ = ["connect_mesh", "local_address"]

logger = logging.getLogger(__name__)

_HELLO = struct.Struct("<qq")
_MAGIC = 0x746F72636864_7463  # "torchd" "tc"


def local_address() -> str:
    """The address peers should dial: TORCHDIST_TCP_HOST, else the interface that
    reaches MASTER_ADDR, else loopback."""
    explicit = os.environ.get("TORCHDIST_TCP_HOST")
    if explicit:
        return explicit
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((master, 9))  # UDP: no packet is sent, only a route lookup
                return probe.getsockname()[0]
        except OSError:
            logger.debug("no route to MASTER_ADDR=%s; using loopback", master)
    return "127.0.0.1"


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError("peer closed the connection during the hello")
        data += chunk
    return data


def _configure(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    return sock


def connect_mesh(store, rank: int, size: int, timeout: float, names: list[int],
                 label: str) -> dict[int, socket.socket]:
    """Return one connected, non-blocking, NODELAY socket per peer (group rank -> socket)."""
    if size == 1:
        return {}
    deadline = time.monotonic() + timeout
    host = local_address()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sockets: dict[int, socket.socket] = {}
    try:
        try:
            listener.bind((host, 0))
            listener.listen(size)
        except OSError as exc:
            raise DistNetworkError(f"{label}: rank {names[rank]} cannot listen on {host}: {exc}") from exc
        port = listener.getsockname()[1]
        store.set(f"tcp/addr/{rank}", f"{host}:{port}")
        for peer in range(rank):
            address = store.get(f"tcp/addr/{peer}").decode()
            sockets[peer] = _configure(_dial(address, rank, peer, deadline, names, label))
        for _ in range(size - 1 - rank):
            remaining = deadline - time.monotonic()
            listener.settimeout(max(remaining, 0.001))
            try:
                conn, _ = listener.accept()
                conn.settimeout(max(deadline - time.monotonic(), 0.001))
                magic, peer = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
            except socket.timeout as exc:
                missing = [names[p] for p in range(rank + 1, size) if p not in sockets]
                raise DistNetworkError(
                    f"{label}: rank {names[rank]} timed out after {timeout:.1f}s waiting for ranks "
                    f"{missing} to connect. Check that every rank of the group was started."
                ) from exc
            except OSError as exc:
                raise DistNetworkError(f"{label}: rank {names[rank]} failed accepting a peer: {exc}") from exc
            if magic != _MAGIC or not rank < peer < size or peer in sockets:
                conn.close()
                raise DistNetworkError(f"{label}: rank {names[rank]} got an unexpected connection "
                                       f"(magic={magic:#x}, rank={peer}); is another job using this store?")
            sockets[peer] = _configure(conn)
    except BaseException:
        for sock in sockets.values():
            sock.close()
        raise
    finally:
        listener.close()
    logger.debug("%s: rank %d connected to %d peers", label, names[rank], len(sockets))
    return sockets


def _dial(address: str, rank: int, peer: int, deadline: float, names: list[int], label: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    delay = 0.01
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=max(deadline - time.monotonic(), 0.001))
            sock.sendall(_HELLO.pack(_MAGIC, rank))
            return sock
        except OSError as exc:
            if time.monotonic() + delay > deadline:
                raise DistNetworkError(
                    f"{label}: rank {names[rank]} could not connect to rank {names[peer]} at {address}: {exc}"
                ) from exc
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
