"""The transport interface: post sends and receives of byte buffers, then drive them.

This is the only thing algorithms (``torchdist._algorithms``) see of the network, so
the TCP, loopback and shared-memory transports share every algorithm (the
shared-memory backend adds its own in ``_algorithms.shm_direct``, which read and
write the peers' memory directly).

Model (gloo's ``Pair``, made non-blocking):

- ``isend(peer, kind, seq, fingerprint, payload)`` and ``irecv(peer, ..., payload)`` *post* a
  :class:`Transfer` and return at once; nothing waits;
- ``wait(transfers, deadline)`` drives every posted transfer (not only the ones
  named) until the named ones are done. One thread does this for all peers, so a
  ring step that sends right and receives left cannot deadlock, however large
  the messages: both directions progress in the same loop;
- payloads are ``memoryview`` s of the caller's memory: a send reads straight from
  the tensor, a receive writes straight into it. The caller keeps the memory
  alive and untouched until the transfer is done;
- ``on_data(nbytes_so_far)`` is called on the driving thread as a receive's bytes
  land, so a reduction can consume data in pieces while the rest is in flight;
- a transport is *healthy* until its first fatal error (peer died, mismatched
  collective, timeout, abort received). Then it is *broken*: every pending and
  later transfer fails with that first error, and the peers were sent an ABORT.

Threading: a transport is driven by one thread at a time (the process group's
engine lock ensures it); ``interrupt()`` is the one call safe from another thread.
Other threads hand work to the driver through ``on_poll``, which the driver calls
whenever it polls (``wait``, ``progress``) while it is set.
"""

from __future__ import annotations

import abc
from typing import Callable, Iterable

from ..errors import DistBackendError
from .framing import HEADER, MsgKind, OpFingerprint, wire_key

__all__ = ["Transfer", "Transport", "PeerTimeout", "EMPTY", "COMPANION_SLICE_S", "advance_receive"]

#: The longest a wait blocks between calls of its transport's ``companion`` (s).
COMPANION_SLICE_S = 0.002

#: The payload of a zero-byte message.
# Writable although empty: receiving into it assigns a zero-length slice, which a
# read-only view (of b"") rejects.
EMPTY = memoryview(bytearray())


class PeerTimeout(DistBackendError):
    """``wait`` reached its deadline; ``peers`` are the group ranks still owing data.

    A transport that knows some of them joined the op (they sent part of it) leaves
    those out when others remain (a rank inside the op waits on someone else) and
    lists them in ``joined``."""

    def __init__(self, message: str, peers: list[int], joined: list[int] | None = None) -> None:
        super().__init__(message)
        self.peers = peers
        self.joined = joined or []


class Transfer:
    """One posted send or receive. ``done`` flips once; ``error`` is set if it failed.

    For a receive, ``peer`` is the expected source (None = any source, P2P only) and
    ``source`` the actual one once matched.
    """

    __slots__ = ("is_send", "kind", "peer", "seq", "fingerprint", "tag", "view", "nbytes",
                 "on_data", "on_done", "done", "error", "source", "key", "header")

    def __init__(self, is_send: bool, kind: MsgKind, peer: int | None, seq: int,
                 fingerprint: OpFingerprint, tag: int, view: memoryview,
                 on_data: Callable[[int], None] | None = None) -> None:
        self.is_send = is_send
        self.kind = kind
        self.peer = peer
        self.seq = seq
        self.fingerprint = fingerprint
        self.tag = tag
        self.view = view
        self.nbytes = view.nbytes
        self.on_data = on_data
        self.on_done: Callable[["Transfer"], None] | None = None
        self.done = False
        self.error: BaseException | None = None
        self.source = peer
        # The header fields in wire order: what we send, or what a receive expects.
        self.key = wire_key(kind, seq, tag, self.nbytes, fingerprint)
        self.header = HEADER.pack(*self.key, 0) if is_send else b""

    def finish(self, error: BaseException | None = None) -> None:
        """Mark done (once); run ``on_done``. Called by transports on the driving thread."""
        if self.done:
            return
        self.error = error
        self.done = True
        if self.on_done is not None:
            self.on_done(self)

    def __repr__(self) -> str:
        direction = "send to" if self.is_send else "recv from"
        return (f"Transfer({self.kind.name} {direction} {self.peer}, seq={self.seq}, "
                f"tag={self.tag}, {self.nbytes} B, done={self.done})")


def advance_receive(channel, n: int) -> None:
    """``n`` more bytes of the receive a transport's inbound ``channel`` fills
    (``channel.target``, ``channel.got`` bytes so far) have landed: report them to its
    ``on_data``, and finish it once complete (``n`` may be 0: a zero-byte message)."""
    channel.got += n
    target = channel.target
    if n and target.on_data is not None:
        target.on_data(channel.got)
    if channel.got == target.nbytes:
        channel.target = None
        target.finish()


class Transport(abc.ABC):
    """A rank's connections to the other ``size - 1`` ranks of one group."""

    rank: int
    size: int
    #: Set from another thread (see ``Engine.post``) to have the driving thread call it
    #: at its next poll, before moving data; the callee clears it.
    on_poll: Callable[[], None] | None = None
    #: Set by a composite backend on its sub-groups' transports
    #: (``backends.auto.HierarchicalBackend``): called on the driving thread at every round
    #: of a blocking ``wait``, which then blocks at most ``COMPANION_SLICE_S`` at a time, so
    #: that another transport, whose op is the one waiting here, keeps moving meanwhile.
    companion: Callable[[], None] | None = None

    @abc.abstractmethod
    def isend(self, peer: int, kind: MsgKind, seq: int, fingerprint: OpFingerprint,
              payload: memoryview, tag: int = 0) -> Transfer:
        """Post a message to ``peer``; raises the transport's error if it is broken."""

    @abc.abstractmethod
    def irecv(self, peer: int | None, kind: MsgKind, seq: int, fingerprint: OpFingerprint,
              payload: memoryview, tag: int = 0,
              on_data: Callable[[int], None] | None = None) -> Transfer:
        """Post a receive into ``payload`` (exactly its size) from ``peer`` (None: any, P2P)."""

    @abc.abstractmethod
    def wait(self, transfers: Iterable[Transfer], deadline: float | None) -> None:
        """Drive progress until every transfer named is done.

        Raises a failed transfer's error; the transport's first fatal error if it
        broke before they were all done (once they are, a later break, such as a
        peer's ABORT read in the same poll as their last bytes, is the next op's
        error, not this one's); or :class:`PeerTimeout` at
        ``deadline`` (a ``time.monotonic()`` value; None = no limit). A timeout does
        not break the transport by itself; the caller decides (see ``fail``). A
        transport may wait past ``deadline`` (bounded) for the ABORT of peers that
        joined the op and time out themselves, whose error names the rank at fault.
        """

    @abc.abstractmethod
    def progress(self, timeout: float) -> None:
        """Drive progress once, blocking up to ``timeout`` s or until ``interrupt()``."""

    @abc.abstractmethod
    def interrupt(self) -> None:
        """Wake a thread blocked in ``progress``/``wait`` (safe from any thread)."""

    @abc.abstractmethod
    def fail(self, error: BaseException, notify: bool = True) -> None:
        """Break the transport with ``error``: fail pending transfers and, with
        ``notify``, ABORT the peers. A rank that leaves cleanly does not notify: peers
        waiting on it see it leave (closed connections, released segments) and the
        others go on."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections; pending transfers fail."""

    #: The first fatal error, or None while healthy (implementations set it in ``fail``).
    _error: BaseException | None = None

    @property
    def error(self) -> BaseException | None:
        """The first fatal error, or None while healthy."""
        return self._error

    @abc.abstractmethod
    def pending(self) -> bool:
        """Whether any posted transfer (e.g. an async P2P receive) is not done."""
