"""Shared-memory transport: the :class:`~.base.Transport` interface over rings in shared memory.

Every ordered pair of ranks ``j -> k`` has a ring buffer (a single-producer,
single-consumer byte stream) in rank ``k``'s segment (layout in ``shm_board``):
``head`` counts the bytes ``j`` has written, ``tail`` the bytes ``k`` has
consumed, both monotonic. Messages are the same 48-byte header plus payload as
on TCP (``framing``) and are matched by the same rules (``matching``), so the
algorithms, the fingerprints and the error messages are the transport's
common ones.

- *send*: copy as much of the head message (header, then payload) as the ring
  has room for, then store ``head``; a large message streams through the ring.
- *receive*: parse a header once 48 bytes are there; copy payload bytes as they
  arrive straight into the receive's buffer (``on_data`` reports them), then
  store ``tail``, which frees room for the sender.
- *parking*: a COLL header with no receive posted means the sender is ahead: we
  leave it in the ring (the sender is throttled when the ring fills) until a
  receive is posted, unless a posted P2P receive could be behind it (then it is
  read into memory; ``Matcher.p2p_waits_on``). Unmatched P2P messages are read
  into memory so that they never block collective traffic behind them.
- *aborts* are not messages: a broken rank publishes a negative step counter and
  its reason on the board, which every waiter checks.
- *waiting*: poll, then sleep on the doorbell, checking deadlines and the
  liveness of the peers we wait for (``Board.idle``). After moving bytes a rank
  rings the doorbell of a peer that sleeps.

Collectives that gain from reading peers' memory directly use the step protocol
(:class:`~.shm_steps.Steps`, ``self.steps``) instead of messages, and read
tensors that live in symmetric memory (:class:`~.shm_heap.SymmetricHeap`,
``self.heap``) where they are.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from typing import Callable, Iterable

from ..errors import DistBackendError, DistNetworkError
from .base import COMPANION_SLICE_S, PeerTimeout, Transfer, Transport, advance_receive
from .framing import HEADER, MsgKind, OpFingerprint
from .matching import (KIND, NBYTES, TAG, Matcher, check_match, deliver_early, receive_early, refuse_contradicting,
                       refuse_parked)
from .shm_board import BLOCK_S, Board
from .shm_heap import SymmetricHeap
from .shm_steps import Steps

__all__ = ["ShmTransport", "RING_BYTES", "CHUNK_BYTES"]

logger = logging.getLogger(__name__)

#: Bytes of each ring (one per ordered pair of ranks).
RING_BYTES = int(os.environ.get("TORCHDIST_SHM_RING", str(256 << 10)))
#: Bytes of each data region of the step protocol: the pipeline chunk of large collectives
#: (the prototype measured 512 KiB-1 MiB best on this VM).
CHUNK_BYTES = int(os.environ.get("TORCHDIST_SHM_CHUNK", str(1 << 20)))
_HSIZE = HEADER.size


class _Out:
    """Our ring into a peer's segment."""

    __slots__ = ("peer", "ctl", "head_i", "tail_i", "data", "head", "sendq", "send_off")

    def __init__(self, board: Board, peer: int) -> None:
        layout = board.layout
        self.peer = peer
        self.ctl = board.ctl[peer]
        self.head_i, self.tail_i = layout.head(board.rank), layout.tail(board.rank)
        offset = layout.ring_offset(board.rank)
        self.data = memoryview(board.segments[peer].buf)[offset:offset + layout.ring]
        self.head = 0
        self.sendq: deque[Transfer] = deque()
        self.send_off = 0


class _In:
    """A peer's ring into our segment."""

    __slots__ = ("peer", "ctl", "head_i", "tail_i", "data", "tail", "target", "got", "parked")

    def __init__(self, board: Board, peer: int) -> None:
        layout = board.layout
        self.peer = peer
        self.ctl = board.ctl[board.rank]
        self.head_i, self.tail_i = layout.head(peer), layout.tail(peer)
        offset = layout.ring_offset(peer)
        self.data = memoryview(board.segments[board.rank].buf)[offset:offset + layout.ring]
        self.tail = 0
        self.target: Transfer | None = None
        self.got = 0
        self.parked: tuple | None = None


class ShmTransport(Transport):
    """The shared-memory implementation of :class:`~torchdist._transport.base.Transport`."""

    def __init__(self, board: Board, heap: SymmetricHeap | None = None) -> None:
        self.board = board
        self.heap = heap
        self.rank, self.size = board.rank, board.size
        self.names, self.label = board.names, board.label
        self.ring = board.layout.ring
        self.steps = Steps(board)
        self._error: BaseException | None = None
        self._matcher = Matcher(self.size)
        self._out: list[_Out | None] = [None] * self.size
        self._in: list[_In | None] = [None] * self.size
        for peer in board.peers:
            self._out[peer] = _Out(board, peer)
            self._in[peer] = _In(board, peer)
        self._wake: set[int] = set()
        self.steps.pump = self._pump
        self._companion: Callable[[], None] | None = None
        # pending() is asked after every collective; these let it answer "no" without
        # looking at every queue while no transfer was posted or started streaming in
        # since it last found none. Bumped by the driving thread *after* it queues, so
        # a pending() on another thread that reads the old count sees the queue or
        # records the old count (and the next call looks again).
        self._activity = 0
        self._quiet_at = -1

    @property
    def companion(self) -> Callable[[], None] | None:
        return self._companion

    @companion.setter
    def companion(self, fn: Callable[[], None] | None) -> None:
        """See ``Transport.companion``: set, it also shortens the naps on the doorbell."""
        self._companion = fn
        self.board.block_s = BLOCK_S if fn is None else COMPANION_SLICE_S

    def _pump(self) -> None:
        """Called by the step protocol while it blocks (``Steps.pump``)."""
        if self._companion is not None:
            self._companion()
        if self.on_poll is not None:
            self.on_poll()
        if self._error is None and self.pending():
            self._step()

    @classmethod
    def connect(cls, store, rank: int, size: int, timeout: float, names: list[int], label: str) -> "ShmTransport":
        return cls(Board(store, rank, size, timeout, names, label, RING_BYTES, CHUNK_BYTES),
                   SymmetricHeap(store, rank, size, timeout, names, label))

    # -- posting -----------------------------------------------------------------------
    def isend(self, peer: int, kind: MsgKind, seq: int, fingerprint: OpFingerprint,
              payload: memoryview, tag: int = 0) -> Transfer:
        if self._error is not None:
            raise self._error
        transfer = Transfer(True, kind, peer, seq, fingerprint, tag, payload)
        out = self._out[peer]
        out.sendq.append(transfer)
        self._activity += 1
        if len(out.sendq) == 1:
            self._push(out)
            self._ring_bells()
        return transfer

    def irecv(self, peer: int | None, kind: MsgKind, seq: int, fingerprint: OpFingerprint,
              payload: memoryview, tag: int = 0,
              on_data: Callable[[int], None] | None = None) -> Transfer:
        if self._error is not None:
            raise self._error
        transfer = Transfer(False, kind, peer, seq, fingerprint, tag, payload, on_data)
        self._activity += 1
        if receive_early(self, self._matcher, transfer):
            return transfer
        if kind == MsgKind.COLL:
            channel = self._in[peer]
            refuse_parked(self, transfer, ((c.peer, c.parked) for c in self._in
                                           if c is not None and c.parked is not None))
            if channel.parked is not None:  # the peer's message was waiting for this receive
                header, channel.parked = channel.parked, None
                self._dispatch(channel, header)
                self._read(channel)
                self._ring_bells()
        else:
            parked = [c for c in self._in if c is not None and c.parked is not None and peer in (None, c.peer)]
            for channel in parked:
                self._unpark(channel)
            if parked:
                self._ring_bells()
        return transfer

    # -- driving -----------------------------------------------------------------------
    def _step(self) -> bool:
        """Move whatever can move on every channel; True if anything did."""
        if self.on_poll is not None:
            self.on_poll()
        moved = False
        for out in self._out:
            if out is not None and out.sendq:
                moved |= self._push(out)
        for channel in self._in:
            if channel is not None and channel.parked is None:
                moved |= self._read(channel)
        self._ring_bells()
        return moved

    def wait(self, transfers: Iterable[Transfer], deadline: float | None) -> None:
        transfers = list(transfers)

        def ready() -> bool:
            if self._error is not None:
                return True
            if self._companion is not None:
                self._companion()
            self._step()
            if self._error is None and not all(t.done for t in transfers):
                self.board.check_aborts()
                return False
            return True

        try:
            if not ready():
                self.board.idle(ready, deadline, lambda: self._owing(transfers), yields=True)
        except (PeerTimeout, DistBackendError) as exc:
            if not isinstance(exc, PeerTimeout):
                self.fail(exc)
            raise
        except BaseException as exc:  # a dead peer: DistNetworkError
            self.fail(exc)
            raise
        if self._error is not None and not all(t.done for t in transfers):
            raise self._error
        for transfer in transfers:
            if transfer.error is not None:
                raise transfer.error

    def progress(self, timeout: float) -> None:
        if self._error is not None:
            return
        try:
            if self._step():
                return
            self.board.check_aborts()
            self.board.sleep_once(timeout, self._step)
            self._step()
            waiting = self._waiting_peers()
            if waiting:
                self.board.check_alive(waiting)
        except DistBackendError as exc:
            self.fail(exc)
        except BaseException as exc:  # noqa: BLE001 - a dead peer fails the pending transfers
            self.fail(exc)

    def _waiting_peers(self) -> list[int]:
        transfers = [t for queue in self._matcher.coll_posted for t in queue] + self._matcher.p2p_posted
        peers = set(self._owing(transfers))
        peers |= {o.peer for o in self._out if o is not None and o.sendq}
        return sorted(peers)

    def _owing(self, transfers: list[Transfer]) -> list[int]:
        """The peers that pending ``transfers`` wait on, for liveness checks and timeouts.

        An any-source receive waits on every peer still alive; once none is, it can
        never complete, and this raises (a peer's death is otherwise seen only by a
        transfer naming it)."""
        pending = [t for t in transfers if not t.done]
        peers = {t.peer for t in pending if t.peer is not None}
        if any(t.peer is None for t in pending):
            board = self.board
            alive = [j for j in board.peers if board.segments[j].owner_alive()]
            if not alive:
                names = [self.names[j] for j in board.peers]
                raise DistNetworkError(
                    f"{self.label}: rank {self.names[self.rank]}'s receive from any source can never complete: "
                    f"it lost every peer, ranks {names} (their processes are gone). They most likely died or "
                    "exited; see their logs for the cause.")
            peers.update(alive)
        return sorted(peers)

    def interrupt(self) -> None:
        try:
            self.board.interrupt()
        except (AttributeError, IndexError):
            pass  # closed

    def pending(self) -> bool:
        """Posted receives, sends not yet in the ring, or a message half read (its
        receive is matched, so no longer "posted", but its bytes still stream in)."""
        activity = self._activity  # read before looking (see __init__)
        if activity == self._quiet_at:
            return False
        matcher = self._matcher
        busy = (bool(matcher.p2p_posted) or any(matcher.coll_posted)
                or any(o is not None and o.sendq for o in self._out)
                or any(c is not None and c.target is not None for c in self._in))
        if not busy:
            self._quiet_at = activity
        return busy

    # -- sending -----------------------------------------------------------------------
    def _push(self, out: _Out) -> bool:
        ring, moved = self.ring, False
        head, tail = out.head, out.ctl[out.tail_i]
        while out.sendq:
            transfer = out.sendq[0]
            total = _HSIZE + transfer.nbytes
            while out.send_off < total:
                room = ring - (head - tail)
                if room == 0:
                    tail = out.ctl[out.tail_i]
                    room = ring - (head - tail)
                    if room == 0:
                        break
                off = out.send_off
                if off < _HSIZE:
                    source, start = transfer.header, off
                    n = min(_HSIZE - off, room)
                else:
                    source, start = transfer.view, off - _HSIZE
                    n = min(total - off, room)
                pos = head % ring
                first = min(n, ring - pos)
                out.data[pos:pos + first] = source[start:start + first]
                if first < n:
                    out.data[:n - first] = source[start + first:start + n]
                head += n
                out.send_off += n
            if out.send_off < total:
                break
            out.send_off = 0
            out.sendq.popleft()
            transfer.finish()
        if head != out.head:
            out.head = head
            # Payload stores above precede this store: the receiver that sees head sees them.
            out.ctl[out.head_i] = head
            self._wake.add(out.peer)
            moved = True
        return moved

    # -- receiving ---------------------------------------------------------------------
    def _take(self, channel: _In, dest: memoryview, n: int) -> None:
        ring, pos = self.ring, channel.tail % self.ring
        first = min(n, ring - pos)
        dest[:first] = channel.data[pos:pos + first]
        if first < n:
            dest[first:n] = channel.data[:n - first]
        channel.tail += n

    def _read(self, channel: _In) -> bool:
        start_tail = channel.tail
        while self._error is None and channel.parked is None:
            avail = channel.ctl[channel.head_i] - channel.tail
            target = channel.target
            if target is None:
                if avail < _HSIZE:
                    break
                raw = bytearray(_HSIZE)
                self._take(channel, memoryview(raw), _HSIZE)
                header = HEADER.unpack(raw)
                if header[KIND] == MsgKind.COLL and not self._matcher.coll_posted[channel.peer]:
                    if refuse_contradicting(self, self._matcher, channel.peer, header):
                        break  # not ahead: in another op (see matching)
                    if not self._matcher.p2p_waits_on(channel.peer):
                        channel.parked = header  # the peer is ahead: leave its payload in the ring
                        break
                self._dispatch(channel, header)
                continue
            if avail == 0:
                break
            n = min(avail, target.nbytes - channel.got)
            self._take(channel, target.view[channel.got:], n)
            advance_receive(channel, n)
        if channel.tail != start_tail:
            # Our copies out of the ring precede this store: the sender overwrites only after it.
            channel.ctl[channel.tail_i] = channel.tail
            self._wake.add(channel.peer)
            return True
        return False

    def _dispatch(self, channel: _In, header: tuple) -> None:
        target = self._matcher.match(channel.peer, header)
        if target is None:  # nobody waits for it yet (P2P, or COLL not parked): keep it in memory
            fp = OpFingerprint(header[1], header[2], header[7], header[4], header[3])
            target = Transfer(False, MsgKind(header[KIND]), channel.peer, header[5], fp, header[TAG],
                              memoryview(bytearray(header[NBYTES])))
            peer = channel.peer
            target.on_done = lambda t: self._early_done(peer, header, bytes(t.view))
        else:
            try:
                check_match(self.label, self.names, self.rank, target, channel.peer, header)
            except DistBackendError as exc:
                self.fail(exc)
                return
        channel.target, channel.got = target, 0
        self._activity += 1
        if target.nbytes == 0:
            advance_receive(channel, 0)

    def _early_done(self, peer: int, header: tuple, payload: bytes) -> None:
        """An unexpected message is in memory: hand it to a receive posted while it
        streamed in, else keep it for a later one."""
        transfer = self._matcher.match(peer, header)
        if transfer is None:
            self._matcher.keep(peer, header, payload)
        else:
            deliver_early(self, transfer, header, payload)

    def _unpark(self, channel: _In) -> None:
        """A P2P receive was posted: read the parked collective message into memory, so
        that the receive's message, possibly behind it, can come (see ``Matcher.p2p_waits_on``)."""
        header, channel.parked = channel.parked, None
        self._dispatch(channel, header)
        self._read(channel)

    def _ring_bells(self) -> None:
        if self._wake:
            self.board.wake(self._wake)
            self._wake.clear()

    # -- failure -----------------------------------------------------------------------
    def fail(self, error: BaseException, notify: bool = True) -> None:
        if self._error is not None:
            return
        self._error = error
        logger.debug("%s: rank %d broken: %s", self.label, self.names[self.rank], error)
        if notify:
            self.board.publish_abort(str(error))
        self._finish_all(error)

    def _finish_all(self, error: BaseException) -> None:
        for transfer in self._matcher.all_posted():
            transfer.finish(error)
        for out in self._out:
            if out is not None:
                while out.sendq:
                    out.sendq.popleft().finish(error)
        for channel in self._in:
            if channel is not None and channel.target is not None:
                channel.target, target = None, channel.target
                target.finish(error)

    def close(self) -> None:
        if self._error is None:
            self._error = DistBackendError(f"{self.label}: the transport of rank "
                                           f"{self.names[self.rank]} was closed")
        self._finish_all(self._error)
        for out in self._out:
            if out is not None:
                out.data.release()
        for channel in self._in:
            if channel is not None:
                channel.data.release()
        self._out, self._in = [None] * self.size, [None] * self.size
        self.steps.close()
        if self.heap is not None:
            self.heap.close()
        self.board.close()
