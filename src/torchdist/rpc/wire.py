"""The RPC wire format: frames on one TCP connection per pair of workers.

Every frame is a fixed header, the buffer lengths, the pickle payload, then the
out-of-band buffers (tensor bytes) back to back::

    offset  size  field
         0     1  kind          FrameKind
         1     1  flags         0 (reserved)
         2     2  nbuf          number of out-of-band buffers
         4     4  reserved      0
         8     8  request id    pairs a RESPONSE/ERROR with its REQUEST
        16     8  context id    distributed autograd context, -1 = none
        24     8  send id       autograd send point within that context, -1 = none
        32     8  payload       length of the pickle (protocol 5) that follows
        40  8*nbuf              length of each out-of-band buffer; bit 63 set: the buffer
                                is a memfd segment passed with the frame (SCM_RIGHTS),
                                not in the stream (same-host peers only)
         .     .  pickle bytes
         .     .  buffer 0, buffer 1, ...

Frame kinds and their order on one connection::

    caller                         callee
      REQUEST(id) ───────────────►  run on the callee's thread pool
      ◄─────────────── RESPONSE(id)  pickled return value
      ◄────────────────── ERROR(id)  pickled (type, message, traceback, worker)
      GOODBYE ───────────────────►  orderly close: EOF after this is not a failure

Zero copy: a sender hands ``sendmsg`` the header, the pickle and memoryviews of
the tensors' own memory in one call; a receiver allocates one ``uint8`` tensor
per buffer and ``recv_into`` s it directly, so tensor bytes are copied only by
the kernel. Small frames are read through a staging buffer, so one ``recv``
usually brings a whole request.

Segments (Unix sockets only, see :mod:`~torchdist.rpc.same_host`): the frame's
first ``sendmsg`` carries the descriptors of its segment buffers, in buffer order.
The kernel delivers them with the first byte of that ``sendmsg``, i.e. while the
frame's header is read into the stage, so a reader queues every descriptor it
receives and a frame takes its own from the front of the queue.

The connection was authenticated (:mod:`torchdist.rpc.handshake`) before the
first frame; nothing here is unpickled.
"""

from __future__ import annotations

import collections
import enum
import os
import socket
import struct
from dataclasses import dataclass

import torch

from . import same_host

__all__ = ["FrameKind", "Frame", "HEADER", "send_frame", "FrameReader"]

HEADER = struct.Struct("<BBHIqqqQ")
assert HEADER.size == 40
_LENGTH = struct.Struct("<Q")
_STAGE = 256 * 1024
_IOV_MAX = 512  # below every platform's IOV_MAX (1024 on Linux)
_IN_SEGMENT = 1 << 63
_ANCILLARY = socket.CMSG_SPACE(same_host.MAX_FDS * 4) if hasattr(socket, "CMSG_SPACE") else 0


class FrameKind(enum.IntEnum):
    REQUEST = 1
    RESPONSE = 2
    ERROR = 3
    GOODBYE = 4


@dataclass
class Frame:
    """A received frame; ``buffers`` are uint8 tensors holding the out-of-band bytes."""

    kind: FrameKind
    request_id: int
    context_id: int
    send_id: int
    payload: bytes | bytearray
    buffers: list[torch.Tensor]


def send_frame(sock: socket.socket, kind: FrameKind, request_id: int, payload: bytes,
               buffers: list[memoryview] = (), context_id: int = -1, send_id: int = -1,
               segments: dict[int, int] | None = None) -> None:
    """Write one frame with ``sendmsg`` straight from ``buffers``' memory (blocking socket).

    ``segments`` maps buffer indexes to memfd descriptors that replace them (Unix
    sockets only); the caller closes them afterwards. The caller holds the
    connection's send lock: frames must not interleave.
    """
    segments = segments or {}
    head = bytearray(HEADER.pack(kind, 0, len(buffers), 0, request_id, context_id, send_id, len(payload)))
    for i, buf in enumerate(buffers):
        head += _LENGTH.pack(buf.nbytes | _IN_SEGMENT if i in segments else buf.nbytes)
    parts: list[memoryview] = [memoryview(head), memoryview(payload)]
    parts.extend(buf for i, buf in enumerate(buffers) if i not in segments)
    parts = [p for p in parts if p.nbytes]
    ancillary = []
    if segments:
        fds = [segments[i] for i in sorted(segments)]
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]
    while parts:
        sent = sock.sendmsg(parts[:_IOV_MAX], ancillary)
        ancillary = []  # descriptors go with the first bytes only
        # Drop what went out; a partial write leaves the rest of one part at the front.
        while sent and parts:
            size = parts[0].nbytes
            if sent >= size:
                sent -= size
                parts.pop(0)
            else:
                parts[0] = parts[0][sent:]
                sent = 0


class FrameReader:
    """Reads frames from one blocking socket; used by that connection's reader thread only."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._stage = bytearray(_STAGE)
        self._view = memoryview(self._stage)
        self._start = 0
        self._end = 0
        self._unix = sock.family == getattr(socket, "AF_UNIX", None)
        self._fds: collections.deque[int] = collections.deque()  # received, not yet claimed by a frame

    def _recv(self, dest: memoryview) -> int:
        if not self._unix:
            return self._sock.recv_into(dest)
        n, ancdata, flags, _ = self._sock.recvmsg_into([dest], _ANCILLARY)
        self._fds.extend(same_host.fds_from(ancdata))
        if flags & socket.MSG_CTRUNC:
            raise ValueError(f"RPC frame with more than {same_host.MAX_FDS} segment descriptors: the stream is out of sync")
        return n

    def close(self) -> None:
        """Close descriptors received for frames that will not be read."""
        while self._fds:
            os.close(self._fds.popleft())

    def _fill(self, need: int) -> None:
        """Make at least ``need`` (<= stage size) unread bytes available in the stage."""
        if self._end - self._start >= need:
            return
        if self._start:  # compact so the wanted bytes fit
            left = self._end - self._start
            self._view[:left] = self._view[self._start:self._end]
            self._start, self._end = 0, left
        while self._end - self._start < need:
            n = self._recv(self._view[self._end:])
            if n == 0:
                raise EOFError("connection closed by the peer")
            self._end += n

    def _read_into(self, dest: memoryview) -> None:
        """Fill ``dest`` from the stage, then straight from the socket."""
        staged = min(self._end - self._start, dest.nbytes)
        if staged:
            dest[:staged] = self._view[self._start:self._start + staged]
            self._start += staged
        got = staged
        total = dest.nbytes
        while got < total:
            if total - got < _STAGE // 4:  # small tail: read it with whatever follows
                self._fill(total - got)
                take = total - got
                dest[got:] = self._view[self._start:self._start + take]
                self._start += take
                return
            n = self._recv(dest[got:])
            if n == 0:
                raise EOFError("connection closed by the peer")
            got += n

    def read_frame(self) -> Frame:
        self._fill(HEADER.size)
        kind, _, nbuf, _, request_id, context_id, send_id, nbytes = HEADER.unpack_from(self._view, self._start)
        self._start += HEADER.size
        try:
            kind = FrameKind(kind)
        except ValueError:
            raise ValueError(f"corrupt RPC frame (kind={kind}): the stream is out of sync") from None
        lengths = []
        for _ in range(nbuf):
            self._fill(_LENGTH.size)
            lengths.append(_LENGTH.unpack_from(self._view, self._start)[0])
            self._start += _LENGTH.size
        if nbytes <= self._end - self._start:
            payload = bytes(self._view[self._start:self._start + nbytes])
            self._start += nbytes
        else:
            payload = bytearray(nbytes)
            self._read_into(memoryview(payload))
        buffers = []
        for length in lengths:
            if length & _IN_SEGMENT:
                if not self._fds:
                    raise ValueError("RPC frame names a segment that did not arrive: the stream is out of sync")
                buffers.append(same_host.map_segment(self._fds.popleft(), length & ~_IN_SEGMENT))
                continue
            buf = torch.empty(length, dtype=torch.uint8)
            if length:
                self._read_into(memoryview(buf.numpy()))
            buffers.append(buf)
        return Frame(kind, request_id, context_id, send_id, payload, buffers)
