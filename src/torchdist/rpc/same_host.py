"""The same-host fast path: a Unix socket per pair, large tensors in memfd segments.

Over loopback TCP a tensor is copied twice by the kernel (into the socket buffer,
out of it) in chunks of the socket buffer, with a wake-up per chunk. Two workers on
the same host do better: the sender writes the tensor once into an anonymous
shared-memory file (``memfd_create``), passes its descriptor over a Unix domain
socket (``SCM_RIGHTS``), and the receiver maps it and builds the tensor over the
mapping: one copy in all, no chunking. The frame itself still travels on the
stream; only buffers of at least :data:`SEGMENT_MIN_BYTES` go through segments
(see :mod:`~torchdist.rpc.wire` for the flag in the length table).

Upgrade, after the TCP connection was authenticated (``handshake.authenticate``),
on that connection::

    both       IDENT(enabled, host identity) ──►◄── IDENT     differ or disabled: keep TCP
    server     listen on an abstract Unix name; NAME(name, token) ──►
    client     connect(name); OK/NO ──►                        NO: keep TCP
    client     token (on the Unix socket) ──►                  server compares, else refuses
    server     ◄── ACK (on the Unix socket)                    both use the Unix socket now

The token, sent over the authenticated connection, proves that the Unix peer is
the worker that passed the job-secret handshake; nothing is unpickled before it.

Host identity is the kernel's boot id and the network namespace (abstract Unix
names live in it): two containers on one machine with separate namespaces use TCP.

Lifetime: segments are anonymous (no name under ``/dev/shm``) and the kernel frees
one when its last descriptor and mapping are gone: the sender closes its descriptor
after the send, the receiver after mapping, and the mapping lives as long as the
received tensor. A worker that dies releases whatever it held; descriptors still in
flight are freed with the socket.
"""

from __future__ import annotations

import array
import hmac
import logging
import os
import secrets
import socket
import struct
import sys

import torch

from .._auth import AuthenticationError
from ..errors import DistNetworkError
from .handshake import recv_exact

__all__ = ["SEGMENT_MIN_BYTES", "MAX_FDS", "available", "upgrade", "make_segment", "map_segment", "fds_from"]

logger = logging.getLogger(__name__)

# Buffers from this size go through a segment. Below it the two kernel copies of the
# Unix socket cost less than creating, filling and mapping a segment (~50 us).
SEGMENT_MIN_BYTES = 1 << 20
MAX_FDS = 64  # segments per frame; further large buffers travel inline
_TOKEN_BYTES = 32
_LEN = struct.Struct("<H")
_UPGRADING = "during the same-host upgrade"  # what recv_exact says was going on


def available() -> bool:
    """memfd, SCM_RIGHTS, abstract Unix names and /proc/self/fd: Linux only."""
    return (sys.platform.startswith("linux") and hasattr(os, "memfd_create") and hasattr(socket, "AF_UNIX")
            and os.path.isdir("/proc/self/fd"))


def _host_identity() -> bytes:
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return b""  # unknown: never matches (see upgrade)
    return boot + b"/" + str(netns).encode()


def _send_blob(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_blob(sock: socket.socket) -> bytes:
    (length,) = _LEN.unpack(recv_exact(sock, _LEN.size, _UPGRADING))
    return recv_exact(sock, length, _UPGRADING)


def upgrade(sock: socket.socket, initiator: bool, peer_name: str, enabled: bool, timeout: float) -> socket.socket:
    """Return a Unix socket to the peer if it runs on this host (and both enable it), else ``sock``.

    ``sock`` is the authenticated TCP connection; it is closed when replaced. The
    side that did not dial it (``initiator`` False) plays the server.
    """
    previous = sock.gettimeout()
    sock.settimeout(timeout)
    try:
        ident = _host_identity() if enabled and available() else b""
        _send_blob(sock, ident)
        theirs = _recv_blob(sock)
        if not ident or ident != theirs:
            return sock
        unix = _client_side(sock, timeout) if initiator else _server_side(sock, timeout)
    except OSError as exc:
        raise DistNetworkError(f"RPC same-host upgrade with {peer_name} failed: {exc}") from exc
    finally:
        sock.settimeout(previous)
    if unix is None:
        logger.info("rpc: %s is on this host but its Unix socket was unreachable: staying on TCP", peer_name)
        return sock
    sock.close()
    return unix


def _server_side(sock: socket.socket, timeout: float) -> socket.socket | None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        name = b"\0torchdist-rpc-" + secrets.token_hex(16).encode()
        listener.bind(name)
        listener.listen(1)
        token = secrets.token_bytes(_TOKEN_BYTES)
        _send_blob(sock, name)
        _send_blob(sock, token)
        if recv_exact(sock, 1, _UPGRADING) != b"\x01":
            return None
        listener.settimeout(timeout)
        unix, _ = listener.accept()
    finally:
        listener.close()
    unix.settimeout(timeout)
    if not hmac.compare_digest(recv_exact(unix, _TOKEN_BYTES, _UPGRADING), token):
        unix.close()
        raise AuthenticationError("RPC same-host upgrade: the Unix socket peer did not present the token sent "
                                  "over the authenticated connection; refused before reading any message")
    unix.sendall(b"\x01")
    unix.settimeout(None)
    return unix


def _client_side(sock: socket.socket, timeout: float) -> socket.socket | None:
    name = _recv_blob(sock)
    token = _recv_blob(sock)
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.settimeout(timeout)
    try:
        unix.connect(name)
    except OSError:
        unix.close()
        sock.sendall(b"\x00")
        return None
    sock.sendall(b"\x01")
    unix.sendall(token)
    if recv_exact(unix, 1, _UPGRADING) != b"\x01":
        unix.close()
        raise AuthenticationError("RPC same-host upgrade: the peer refused this worker's token")
    unix.settimeout(None)
    return unix


# -- segments --------------------------------------------------------------------------------
def make_segment(buf: memoryview) -> int:
    """A memfd holding a copy of ``buf``; the caller sends it and closes it.

    ``write`` rather than ``mmap`` + copy: the kernel allocates and fills the pages in
    one pass, without a page fault per 4 KiB (measured 2x faster for 64 MiB here).
    """
    fd = os.memfd_create("torchdist-rpc", os.MFD_CLOEXEC)
    try:
        done = 0
        total = buf.nbytes
        while done < total:
            done += os.write(fd, buf[done:])
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_segment(fd: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over the segment (no copy); closes ``fd``. The mapping lives with the tensor.

    Mapped by torch (``from_file`` on ``/proc/self/fd``), which closes its own
    descriptor after ``mmap``: Python's ``mmap`` would keep a duplicate open for the
    tensor's lifetime, and a worker holding many received tensors would run out.
    """
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ValueError(f"corrupt RPC frame: a segment of {size} bytes for a buffer of {nbytes} bytes")
        return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
    finally:
        os.close(fd)


def fds_from(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors of the SCM_RIGHTS messages in ``recvmsg``'s ancillary data."""
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            ints = array.array("i")
            ints.frombytes(data[:len(data) - len(data) % ints.itemsize])
            fds.extend(ints)
    return fds
