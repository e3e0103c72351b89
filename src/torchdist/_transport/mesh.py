"""Bootstrap a full TCP mesh between the ranks of a group through its store.

Each rank listens on an ephemeral port and publishes ``host:port`` under the key
``tcp/addr/<rank>`` of the group's (already prefixed, so private) store. Rank ``r``
then connects to every lower rank and accepts one connection from every higher
rank. ``connect`` completes in the peer's listen backlog before it calls
``accept``, so the order cannot deadlock. The connecting side introduces itself
with a 24-byte hello (magic, rank, group size) so the acceptor knows which rank
each socket is, and that both were started for a group of the same size.

The acceptor reads hellos from every pending connection at once (a selector): a
stranger that connects and says nothing, or says something else, is dropped and
delays no one. While it waits it checks, about once a second, that the store still
answers: if the rank hosting it died, so did the rendezvous, and waiting out the
timeout would only hide that.

OS errors become :class:`~torchdist.errors.DistNetworkError` here (with the OSError
as cause); a peer that never shows up raises at the deadline naming it.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import struct
import time

from ..errors import DistError, DistNetworkError

__all__ = ["connect_mesh", "local_address"]

logger = logging.getLogger(__name__)

_HELLO = struct.Struct("<qqq")  # magic, rank, group size
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


#: How often (s) an acceptor waiting for its peers checks that the store still answers.
_STORE_CHECK_S = 1.0


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
            sockets[peer] = _configure(_dial(address, rank, size, peer, deadline, names, label))
        _accept_higher(listener, store, rank, size, deadline, timeout, sockets, names, label)
    except BaseException:
        for sock in sockets.values():
            sock.close()
        raise
    finally:
        listener.close()
    logger.debug("%s: rank %d connected to %d peers", label, names[rank], len(sockets))
    return sockets


def _accept_higher(listener: socket.socket, store, rank: int, size: int, deadline: float, timeout: float,
                   sockets: dict[int, socket.socket], names: list[int], label: str) -> None:
    """Accept one connection from each rank above ``rank`` into ``sockets``, reading
    every pending connection's hello as its bytes come."""
    hellos: dict[socket.socket, bytes] = {}  # connections whose hello is not complete yet
    selector = selectors.DefaultSelector()
    listener.setblocking(False)
    selector.register(listener, selectors.EVENT_READ)
    next_store_check: float | None = time.monotonic() + _STORE_CHECK_S
    try:
        while len(sockets) < size - 1:
            now = time.monotonic()
            if now >= deadline:
                missing = [names[p] for p in range(rank + 1, size) if p not in sockets]
                raise DistNetworkError(
                    f"{label}: rank {names[rank]} timed out after {timeout:.1f}s waiting for ranks "
                    f"{missing} to connect. Check that every rank of the group was started.")
            if next_store_check is not None and now >= next_store_check:
                next_store_check = now + _STORE_CHECK_S if _check_store(store, rank, names, label) else None
            wake = deadline if next_store_check is None else min(deadline, next_store_check)
            for key, _ in selector.select(wake - now):
                if key.fileobj is listener:
                    try:
                        conn, _ = listener.accept()
                    except BlockingIOError:
                        continue
                    except OSError as exc:
                        raise DistNetworkError(f"{label}: rank {names[rank]} failed accepting a peer: {exc}") from exc
                    conn.setblocking(False)
                    hellos[conn] = b""
                    selector.register(conn, selectors.EVENT_READ)
                    continue
                conn = key.fileobj
                try:
                    chunk = conn.recv(_HELLO.size - len(hellos[conn]))
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if not chunk:  # closed before a full hello: nobody we wait for
                    _drop(selector, hellos, conn, rank, names, "closed the connection before its hello")
                    continue
                hellos[conn] += chunk
                if len(hellos[conn]) < _HELLO.size:
                    continue
                magic, peer, peer_size = _HELLO.unpack(hellos[conn])
                if magic != _MAGIC:
                    _drop(selector, hellos, conn, rank, names, "sent no torchdist hello")
                    continue
                if peer_size != size:
                    who = names[peer] if 0 <= peer < size else peer
                    raise DistNetworkError(
                        f"{label}: rank {who} was started for a group of {peer_size} ranks, but rank {names[rank]} "
                        f"for one of {size}. Start every rank with the same world size (WORLD_SIZE / "
                        "--nproc-per-node x --nnodes) or the same ranks list.")
                if not rank < peer < size or peer in sockets:
                    raise DistNetworkError(
                        f"{label}: rank {names[rank]} was dialed by a second rank {peer} (or one that should "
                        f"not dial it); two processes were probably started with the same RANK.")
                selector.unregister(conn)
                del hellos[conn]
                sockets[peer] = _configure(conn)
    finally:
        for conn in hellos:
            conn.close()
        selector.close()


def _drop(selector: selectors.BaseSelector, hellos: dict, conn: socket.socket, rank: int, names: list[int],
          why: str) -> None:
    """Forget a connection that is not a peer of this mesh (a port scanner, another program)."""
    logger.warning("mesh: rank %d dropped a connection from %s that %s", names[rank], _peer_name(conn), why)
    selector.unregister(conn)
    del hellos[conn]
    conn.close()


def _peer_name(conn: socket.socket) -> str:
    try:
        host, port = conn.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "an unknown address"


def _check_store(store, rank: int, names: list[int], label: str) -> bool:
    """Raise if the store no longer answers (the rank hosting it died). False: this
    store cannot be checked (a user's store without ``check``), so stop trying."""
    try:
        store.check([f"tcp/addr/{rank}"])
    except (DistError, OSError) as exc:
        raise DistNetworkError(
            f"{label}: rank {names[rank]} lost the store while waiting for its peers to connect ({exc}); the "
            "rank hosting it (usually rank 0) has probably died.") from exc
    except RuntimeError:  # Store's "Not implemented."
        return False
    return True


def _dial(address: str, rank: int, size: int, peer: int, deadline: float, names: list[int],
          label: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    delay = 0.01
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=max(deadline - time.monotonic(), 0.001))
            sock.sendall(_HELLO.pack(_MAGIC, rank, size))
            return sock
        except OSError as exc:
            if time.monotonic() + delay > deadline:
                raise DistNetworkError(
                    f"{label}: rank {names[rank]} could not connect to rank {names[peer]} at {address}: {exc}"
                ) from exc
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
