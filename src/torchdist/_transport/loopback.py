"""An in-process transport: many ranks as threads of one process, for tests.

A :class:`LoopbackFabric` of ``size`` ranks hands each thread a
:class:`LoopbackTransport`. It is a real implementation of the interface, with
the same matching, parking, ABORT and timeout rules as TCP (it shares
``matching.Matcher``), and one deliberate strictness: a collective send
completes only when the receiver has taken the bytes (rendezvous, as if socket
buffers were empty). An algorithm that would deadlock on full buffers over TCP
therefore deadlocks here at every size, and a test catches it at once.
P2P sends complete eagerly, as they do over TCP while the receiver buffers them.

The receiver copies straight from the sender's memoryview into its own, in
``piece``-byte steps, calling ``on_data`` after each, as a socket would deliver.

:class:`RecordingFabric` also logs every message as ``(src, dst, kind, nbytes)``
so tests can assert an algorithm's schedule (who sends how much to whom).

Threading: one ``threading.Condition`` guards the whole fabric; each waiter is
woken by ``notify_all`` whenever anything changes.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Iterable

from ..errors import DistBackendError
from .base import PeerTimeout, Transfer, Transport
from .framing import MsgKind, OpFingerprint
from .matching import KIND, Matcher, check_match

__all__ = ["LoopbackFabric", "RecordingFabric", "LoopbackTransport"]


class LoopbackFabric:
    """``size`` connected in-process transports: ``fabric.transports[rank]``."""

    def __init__(self, size: int, piece: int = 1 << 20, label: str = "loopback") -> None:
        self.size = size
        self.piece = piece
        self.label = label
        self.cond = threading.Condition(threading.RLock())
        self.transports = [LoopbackTransport(self, rank) for rank in range(size)]

    def record(self, src: int, dst: int, kind: MsgKind, nbytes: int) -> None:
        """Hook for :class:`RecordingFabric`; called under the fabric lock."""


class RecordingFabric(LoopbackFabric):
    """A fabric that logs every message sent as ``(src, dst, kind, nbytes)``."""

    def __init__(self, size: int, piece: int = 1 << 20, label: str = "loopback") -> None:
        super().__init__(size, piece, label)
        self.log: list[tuple[int, int, MsgKind, int]] = []

    def record(self, src: int, dst: int, kind: MsgKind, nbytes: int) -> None:
        self.log.append((src, dst, kind, nbytes))

    def bytes_between(self, kind: MsgKind = MsgKind.COLL) -> dict[tuple[int, int], int]:
        """Total payload bytes per (src, dst) pair."""
        totals: dict[tuple[int, int], int] = {}
        for src, dst, message_kind, nbytes in self.log:
            if message_kind is kind:
                totals[src, dst] = totals.get((src, dst), 0) + nbytes
        return totals

    def clear(self) -> None:
        with self.cond:
            self.log.clear()


class LoopbackTransport(Transport):
    """One rank's end of a :class:`LoopbackFabric`."""

    def __init__(self, fabric: LoopbackFabric, rank: int) -> None:
        self.fabric = fabric
        self.rank, self.size = rank, fabric.size
        self.names = list(range(fabric.size))
        self._error: BaseException | None = None
        self.hung_up = False
        self._matcher = Matcher(fabric.size)
        self.inbox: list[deque[Transfer]] = [deque() for _ in range(fabric.size)]
        self._parked = [False] * fabric.size
        self._sent: list[Transfer] = []  # our sends not yet taken, for pending()

    def isend(self, peer: int, kind: MsgKind, seq: int, fingerprint: OpFingerprint,
              payload: memoryview, tag: int = 0) -> Transfer:
        with self.fabric.cond:
            if self._error is not None:
                raise self._error
            transfer = Transfer(True, kind, peer, seq, fingerprint, tag, payload)
            receiver = self.fabric.transports[peer]
            if receiver.hung_up:
                # Like a half-closed TCP peer: what it sent before hanging up (an ABORT
                # with its reason) is read first, and names the cause better than we can.
                self._pump(peer)
                if self._error is None:
                    self._fail_locked(DistBackendError(f"{self.fabric.label}: rank {peer} is gone"), True)
                raise self._error
            receiver.inbox[self.rank].append(transfer)
            self._sent.append(transfer)
            self.fabric.record(self.rank, peer, kind, transfer.nbytes)
            self.fabric.cond.notify_all()
            return transfer

    def irecv(self, peer: int | None, kind: MsgKind, seq: int, fingerprint: OpFingerprint,
              payload: memoryview, tag: int = 0,
              on_data: Callable[[int], None] | None = None) -> Transfer:
        with self.fabric.cond:
            if self._error is not None:
                raise self._error
            transfer = Transfer(False, kind, peer, seq, fingerprint, tag, payload, on_data)
            early = self._matcher.post(transfer)
            if early is not None:
                header, data = early
                self._check(transfer, transfer.source, header)
                transfer.view[:] = data
                if on_data is not None:
                    on_data(transfer.nbytes)
                transfer.finish()
            elif kind is MsgKind.COLL:
                self._parked[peer] = False
            else:  # a P2P message may be behind a parked collective one (Matcher.p2p_waits_on)
                for src in range(self.size):
                    if peer is None or peer == src:
                        self._parked[src] = False
            self._pump_all()
            return transfer

    def _check(self, transfer: Transfer, peer: int, header: tuple) -> None:
        try:
            check_match(self.fabric.label, self.names, self.rank, transfer, peer, header)
        except DistBackendError as exc:
            self._fail_locked(exc, True)
            raise

    # -- moving bytes (receiver side, under the fabric lock) --------------------------
    def _pump_all(self) -> None:
        moved = False
        for src in range(self.size):
            moved |= self._pump(src)
            if self.fabric.transports[src].hung_up and not self.inbox[src] and self._error is None:
                self._orphaned(src)
        if moved:
            self.fabric.cond.notify_all()

    def _orphaned(self, src: int) -> None:
        """``src`` is gone and sent nothing more: fail if we still wait on it (as TCP does)."""
        matcher = self._matcher
        if matcher.coll_posted[src] or any(t.peer == src for t in matcher.p2p_posted):
            self._fail_locked(DistBackendError(f"{self.fabric.label}: rank {self.rank} lost rank {src}: "
                                               "it closed the connection"), True)

    def _pump(self, src: int) -> bool:
        queue, moved = self.inbox[src], False
        draining = self.fabric.transports[src].hung_up
        while queue and not self._parked[src] and self._error is None:
            send = queue[0]
            header = send.key  # the fields its header carries
            target = None
            if header[KIND] != MsgKind.ABORT:
                target = self._matcher.match(src, header)
            if (target is None and header[KIND] == MsgKind.COLL and not draining
                    and not self._matcher.p2p_waits_on(src)):
                self._parked[src] = True
                break
            if target is not None:
                try:
                    self._check(target, src, header)
                except DistBackendError:
                    break
                self._copy(send.view, target)
            queue.popleft()
            send.finish()
            moved = True
            if target is None:
                self._keep(src, header, bytes(send.view))
            else:
                target.finish()
        return moved

    def _copy(self, source: memoryview, target: Transfer) -> None:
        piece, nbytes = self.fabric.piece, target.nbytes
        for start in range(0, nbytes, piece):
            stop = min(start + piece, nbytes)
            target.view[start:stop] = source[start:stop]
            if target.on_data is not None:
                target.on_data(stop)

    def _keep(self, src: int, header: tuple, payload: bytes) -> None:
        if header[KIND] == MsgKind.ABORT:
            reason = payload.decode("utf-8", "replace")
            self._fail_locked(DistBackendError(f"{self.fabric.label}: rank {self.rank}: the group was "
                                               f"aborted by rank {src}: {reason}"), False)
        else:
            self._matcher.keep(src, header, payload)

    # -- driving ----------------------------------------------------------------------
    def wait(self, transfers: Iterable[Transfer], deadline: float | None) -> None:
        transfers = list(transfers)
        with self.fabric.cond:
            while True:
                if self.on_poll is not None:
                    self.on_poll()
                self._pump_all()
                if all(t.done for t in transfers):
                    break  # a break after that is the next op's (see Transport.wait)
                if self._error is not None:
                    raise self._error
                timeout = None if deadline is None else deadline - time.monotonic()
                if timeout is not None and timeout <= 0:
                    peers = sorted({t.peer for t in transfers if not t.done and t.peer is not None})
                    raise PeerTimeout(f"{self.fabric.label}: timed out waiting for ranks {peers}", peers)
                self.fabric.cond.wait(timeout)
        for transfer in transfers:
            if transfer.error is not None:
                raise transfer.error

    def progress(self, timeout: float) -> None:
        with self.fabric.cond:
            if self.on_poll is not None:
                self.on_poll()
            self._pump_all()
            self.fabric.cond.wait(timeout)
            self._pump_all()

    def interrupt(self) -> None:
        with self.fabric.cond:
            self.fabric.cond.notify_all()

    def pending(self) -> bool:
        with self.fabric.cond:
            self._sent = [t for t in self._sent if not t.done]
            return self._matcher.pending() or bool(self._sent)

    # -- failure ----------------------------------------------------------------------
    def fail(self, error: BaseException, notify: bool = True) -> None:
        with self.fabric.cond:
            self._fail_locked(error, notify)

    def _fail_locked(self, error: BaseException, notify: bool) -> None:
        if self._error is not None:
            return
        self._error = error
        if notify:
            payload = memoryview(str(error).encode("utf-8", "replace"))
            for peer in range(self.size):
                if peer != self.rank:
                    self.fabric.transports[peer].inbox[self.rank].append(
                        Transfer(True, MsgKind.ABORT, peer, 0, OpFingerprint(), 0, payload))
            self.hung_up = True  # like TCP's shutdown: peers parked on us drain to the ABORT
        for transfer in self._matcher.all_posted():
            transfer.finish(error)
        self.fabric.cond.notify_all()

    def close(self) -> None:
        with self.fabric.cond:
            if self._error is None:
                self._error = DistBackendError(f"{self.fabric.label}: rank {self.rank} was closed")
            for transfer in self._matcher.all_posted():
                transfer.finish(self._error)
            self.hung_up = True
            self.fabric.cond.notify_all()
