"""MPI transport: the transport interface over an MPI communicator (through mpi4py).

For clusters that already run MPI: the job starts under ``mpiexec``, and messages
travel by MPI's non-blocking point-to-point calls over whatever fabric the MPI
library drives. Everything above the interface (algorithms, sequence numbers,
fingerprints, matching, group health) is the TCP backend's.

Streams. MPI keeps the messages of one (source, tag, communicator) in order and
orders nothing across tags, so each stream has a tag of its own::

    tag  stream      carries
      1  COLL        collective frames: a 48-byte header (``framing.HEADER``), then
                     the payload if it is at most ``INLINE`` bytes
      2  COLL_DATA   the payloads of larger collective messages, in frame order
      3  P2P         point-to-point frames
      4  P2P_DATA    their larger payloads
      5  CTRL        ABORT, WAITING and LEFT notices, read whatever the other streams
                     hold (a WAITING notice is never stuck behind a parked frame)

A small payload rides in its frame: one MPI message and one copy are cheaper than
two messages. A larger one is its own message, sent from the tensor's memory and
received into the destination's, posted as soon as its frame is matched.

Receiving. One frame receive per peer is always posted on COLL. A frame that
matches a posted receive is delivered and the receive posted again. One that
finds none means the peer is ahead: it is *parked* and the frame receive is not
posted again, so the peer's later messages wait inside MPI (its large sends stay
pending: the sender is throttled) until a receive is posted (``matching`` has the
rules, including the mismatches found while parked). P2P frames come through one
any-source receive; a P2P message nobody waits for yet is read into memory (the
next P2P frame is read only after it, so messages of one sender keep their order).

Leaving. MPI has no hang-up: ``close`` sends each peer a LEFT notice with the
number of COLL and P2P frames it sent it. As tags are not ordered with each
other, the peer counts frames; once it has them all, the rank is gone, and
anything still waiting on it fails naming it. The backend closes its transports
when the process exits, so a rank that dies of an exception is named at once; one
killed outright is the MPI launcher's to handle (mpiexec stops the job).

Threading: one thread drives the transport at a time (see ``base``); MPI must
provide ``MPI_THREAD_MULTIPLE``, as different groups' transports are driven by
different threads. ``interrupt`` only sets a flag the polling loop reads.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from typing import Callable, Iterable, NamedTuple

from ..errors import DistBackendError, DistNetworkError
from .base import COMPANION_SLICE_S, Transfer, Transport
from .framing import HEADER, Header, MsgKind, OpFingerprint
from .matching import (KIND, NBYTES, SEQ, Matcher, check_match, deliver_early, receive_early, refuse_contradicting,
                       refuse_parked)
from .waits import WaitChains

__all__ = ["MpiTransport", "INLINE"]

logger = logging.getLogger(__name__)

#: Payloads up to this many bytes travel inside their frame.
INLINE = 16 << 10
_COLL, _COLL_DATA, _P2P, _P2P_DATA, _CTRL = 1, 2, 3, 4, 5
_HSIZE = HEADER.size
_unpack_from = HEADER.unpack_from
#: An ABORT's reason is cut to fit the control receive's buffer.
_CTRL_PAYLOAD = 4096
#: LEFT's payload: the COLL and P2P frames the leaving rank sent to the receiver.
_COUNTS = struct.Struct("<qq")
#: How long ``wait``/``progress`` poll without sleeping; then sleeps grow to ``_NAP_MAX_S``.
_SPIN_S = float(os.environ.get("TORCHDIST_MPI_SPIN_US", "100")) * 1e-6
_NAP_MAX_S = 0.001
#: At most this many ``Testsome`` rounds per poll while P2P frames keep arriving.
_POLL_ROUNDS = 64
#: How long a send to a peer that left may still finish: the peer may have taken it before
#: it left, and its completion reach us after the LEFT notice (s).
_LEFT_GRACE_S = 0.5
#: How long ``close`` lets its notices leave (s).
_FLUSH_S = 1.0
#: Sends a closed transport could not see complete, with the memory they read:
#: MPI may still read it, so it must outlive the transport.
_LINGERING: list[tuple] = []


class _Action(NamedTuple):
    """What a posted request is for. ``handler(transfer)`` if the request serves a
    transfer (which fails with the transport), else ``handler(source rank)``."""

    handler: Callable
    transfer: Transfer | None
    buffer: object  # kept alive while MPI may use it
    is_send: bool


class _Peer:
    """What this rank knows of one peer's streams."""

    __slots__ = ("peer", "frame", "parked", "frames_in", "left", "heard_seq", "heard_at")

    def __init__(self, peer: int) -> None:
        self.peer = peer
        self.frame = bytearray(_HSIZE + INLINE)  # the COLL frame receive's buffer
        self.parked: tuple | None = None  # a COLL header waiting for its receive (payload in ``frame``)
        self.frames_in = [0, 0]  # COLL and P2P frames received from the peer
        self.left: tuple[int, int] | None = None  # its LEFT counts, once it closed
        self.heard_seq = -1  # the latest collective the peer sent us a message of,
        self.heard_at = 0.0  # and when its first message of it arrived

    def gone(self) -> bool:
        """The peer closed and every frame it sent us has arrived."""
        left = self.left
        return left is not None and self.frames_in[0] >= left[0] and self.frames_in[1] >= left[1]


class MpiTransport(Transport):
    """The MPI implementation of :class:`~torchdist._transport.base.Transport`."""

    def __init__(self, comm, names: list[int] | None = None, label: str = "mpi") -> None:
        from mpi4py import MPI  # imported with the backend, which checked it is there

        self._mpi = MPI
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.names = names if names is not None else list(range(self.size))
        self.label = label
        self._error: BaseException | None = None
        self._chains = WaitChains(self.rank, self.names, label)  # naming the rank at fault at a timeout
        self._interrupted = False
        self._p2p_arrived = False  # a P2P frame came in the last Testsome (see _poll)
        self._matcher = Matcher(self.size)
        self._peers: list[_Peer | None] = [None if p == self.rank else _Peer(p) for p in range(self.size)]
        self._sent = [[0, 0] for _ in range(self.size)]  # COLL and P2P frames sent to each peer
        self._departing: dict[int, float] = {}  # peers gone with our sends under way: until when we wait
        # Posted MPI requests and, at the same index, an ``_Action``: what to run on the
        # driving thread when the request completes, and what MPI reads or writes.
        self._requests: list = []
        self._actions: list[_Action] = []
        self._statuses: list = []
        self._p2p_frame = bytearray(_HSIZE + INLINE)
        self._ctrl_frame = bytearray(_HSIZE + _CTRL_PAYLOAD)
        for state in self._peers:
            if state is not None:
                self._post_coll_frame(state)
        self._post_p2p_frame()
        self._post_ctrl_frame()

    # -- posting -----------------------------------------------------------------------
    def isend(self, peer: int, kind: MsgKind, seq: int, fingerprint: OpFingerprint,
              payload: memoryview, tag: int = 0) -> Transfer:
        if self._error is not None:
            raise self._error
        transfer = Transfer(True, kind, peer, seq, fingerprint, tag, payload)
        state = self._peers[peer]
        if state.gone():
            self._need(state, sending=True)
            raise self._error
        if kind == MsgKind.COLL:
            refuse_parked(self, transfer, self._parked())
        stream = _COLL if kind == MsgKind.COLL else _P2P
        self._sent[peer][stream == _P2P] += 1
        if transfer.nbytes <= INLINE:
            frame = transfer.header + bytes(payload)  # one message, one small copy
            self._post(self.comm.Isend([frame, self._mpi.BYTE], peer, stream), Transfer.finish, transfer, frame,
                       is_send=True)
        else:
            # Two messages: the transfer is done when both are, in either order.
            countdown = [2]
            frame = transfer.header
            self._post(self.comm.Isend([frame, self._mpi.BYTE], peer, stream),
                       _countdown(countdown), transfer, frame, is_send=True)
            self._post(self.comm.Isend([payload, self._mpi.BYTE], peer, stream + 1),
                       _countdown(countdown), transfer, payload, is_send=True)
        return transfer

    def irecv(self, peer: int | None, kind: MsgKind, seq: int, fingerprint: OpFingerprint,
              payload: memoryview, tag: int = 0,
              on_data: Callable[[int], None] | None = None) -> Transfer:
        if self._error is not None:
            raise self._error
        transfer = Transfer(False, kind, peer, seq, fingerprint, tag, payload, on_data)
        if receive_early(self, self._matcher, transfer):
            return transfer
        if kind == MsgKind.COLL:
            refuse_parked(self, transfer, self._parked())
            state = self._peers[peer]
            if state.parked is not None:  # the peer's frame was waiting for this receive
                header, state.parked = state.parked, None
                self._on_coll_header(state, header)
        if peer is None:
            self._need_any()
        else:
            self._need(self._peers[peer])
        if self._error is not None:
            raise self._error
        return transfer

    def _parked(self) -> Iterable[tuple[int, tuple]]:
        return ((s.peer, s.parked) for s in self._peers if s is not None and s.parked is not None)

    def _sending(self) -> Iterable[Transfer]:
        return (a.transfer for a in self._actions if a.is_send and a.transfer is not None)

    def _post(self, request, handler: Callable, transfer: Transfer | None, buffer: object,
              is_send: bool = False) -> None:
        self._requests.append(request)
        self._actions.append(_Action(handler, transfer, buffer, is_send))

    def _post_coll_frame(self, state: _Peer) -> None:
        request = self.comm.Irecv([state.frame, self._mpi.BYTE], state.peer, _COLL)
        self._post(request, lambda _source: self._on_coll_frame(state), None, state.frame)

    def _post_p2p_frame(self) -> None:
        request = self.comm.Irecv([self._p2p_frame, self._mpi.BYTE], self._mpi.ANY_SOURCE, _P2P)
        self._post(request, self._on_p2p_frame, None, self._p2p_frame)

    def _post_ctrl_frame(self) -> None:
        request = self.comm.Irecv([self._ctrl_frame, self._mpi.BYTE], self._mpi.ANY_SOURCE, _CTRL)
        self._post(request, self._on_ctrl_frame, None, self._ctrl_frame)

    # -- driving -----------------------------------------------------------------------
    def wait(self, transfers: Iterable[Transfer], deadline: float | None) -> None:
        transfers = list(transfers)
        self._chains.begin(transfers)
        extended = False
        while not all(t.done for t in transfers):
            if self._error is not None:
                raise self._error
            timeout = 1.0 if deadline is None else deadline - time.monotonic()
            if timeout <= 0:
                # The ranks we wait on may be waiting themselves: tell every peer whom we wait
                # on and give them slack to tell us theirs (see waits.py).
                peers, joined = self._chains.owing(
                    transfers, (s.peer for s in self._peers if s is not None and not s.gone()),
                    lambda p: self._peers[p].heard_seq)
                later = None if extended else self._chains.extend(
                    transfers, deadline, peers, joined, lambda p: self._peers[p].heard_at)
                if later is None:
                    raise self._chains.timeout(peers, joined, transfers[0].seq)
                if transfers[0].kind is MsgKind.COLL:
                    payload = WaitChains.notice(peers[:_CTRL_PAYLOAD // 4])
                    self._notify(MsgKind.WAITING, lambda peer: payload, transfers[0].seq)
                deadline, extended = later, True
                continue
            if self.companion is not None:
                self.companion()
                timeout = min(timeout, COMPANION_SLICE_S)
            self.progress(timeout)
        for transfer in transfers:
            if transfer.error is not None:
                raise transfer.error

    def progress(self, timeout: float) -> None:
        """Poll the posted requests until one completes, ``timeout`` passes, or
        ``interrupt``: without sleeping for ``_SPIN_S``, then with naps that grow (an
        MPI library offers no wait that another thread can cut short)."""
        if self.on_poll is not None:
            self.on_poll()
        if self._departing:
            self._check_departing()
        if self._poll():
            return
        start = time.perf_counter()
        nap = 20e-6
        while True:
            if self._interrupted:  # cleared where seen: one set before we got here still counts
                self._interrupted = False
                return
            elapsed = time.perf_counter() - start
            if elapsed >= timeout:
                return
            if elapsed < _SPIN_S:
                os.sched_yield()
            else:
                time.sleep(min(nap, timeout - elapsed))
                nap = min(2 * nap, _NAP_MAX_S)
            if self._poll():
                return

    def _poll(self) -> bool:
        """Test the posted requests; run the handlers of those done. True if any were.

        Rounds repeat (up to ``_POLL_ROUNDS``) while P2P frames arrive: their one receive
        is posted again by its handler, and more may be queued behind it (a rank with
        thousands of messages queued took one per call)."""
        any_done = False
        for _round in range(_POLL_ROUNDS):
            self._p2p_arrived = False
            if not self._test_once():
                break
            any_done = True
            if not self._p2p_arrived:
                break
        return any_done

    def _test_once(self) -> bool:
        """One ``Testsome``; run the handlers of the requests done. True if any were (or
        if MPI raised, which breaks the transport)."""
        requests = self._requests
        if not requests:
            return False
        statuses = self._statuses
        if len(statuses) < len(requests):
            statuses.extend(self._mpi.Status() for _ in range(len(requests) - len(statuses)))
        try:
            done = self._mpi.Request.Testsome(requests, statuses)
        except self._mpi.Exception as exc:  # e.g. a message larger than its receive: a broken peer
            self.fail(DistBackendError(f"{self.label}: rank {self.names[self.rank]}: MPI failed: {exc}"))
            return True
        if not done:
            return False
        actions = self._actions
        finished = [(actions[i], statuses[k].Get_source()) for k, i in enumerate(done)]
        # Handlers post new requests: take the finished ones out first (a few deletions
        # move pointers in C; rebuilding the lists in Python cost O(posted) per call).
        if len(done) <= 16:
            for i in sorted(done, reverse=True):
                del requests[i]
                del actions[i]
        else:
            gone = set(done)
            self._requests = [r for i, r in enumerate(requests) if i not in gone]
            self._actions = [a for i, a in enumerate(actions) if i not in gone]
        for action, source in finished:
            if action.transfer is None:
                action.handler(source)
            elif not action.transfer.done:
                action.handler(action.transfer)
        return True

    def interrupt(self) -> None:
        self._interrupted = True

    def pending(self) -> bool:
        return self._matcher.pending() or any(a.transfer is not None and not a.transfer.done for a in self._actions)

    # -- receiving ---------------------------------------------------------------------
    def _on_coll_frame(self, state: _Peer) -> None:
        state.frames_in[0] += 1
        header = _unpack_from(state.frame, 0)
        if header[SEQ] != state.heard_seq:
            state.heard_seq, state.heard_at = header[SEQ], time.monotonic()
        target = self._matcher.match(state.peer, header)
        if target is None:
            if not refuse_contradicting(self, self._matcher, state.peer, header, self._sending()):
                state.parked = header  # the peer is ahead: its next frames wait inside MPI
            return
        self._deliver(state.peer, header, target, state.frame, _COLL_DATA)
        self._post_coll_frame(state)
        self._need(state)

    def _on_coll_header(self, state: _Peer, header: tuple) -> None:
        """A parked frame meets the receive just posted for it."""
        target = self._matcher.match(state.peer, header)
        self._deliver(state.peer, header, target, state.frame, _COLL_DATA)
        self._post_coll_frame(state)

    def _on_p2p_frame(self, source: int) -> None:
        self._p2p_arrived = True  # (see _poll)
        state = self._peers[source]
        state.frames_in[1] += 1
        header = _unpack_from(self._p2p_frame, 0)
        target = self._matcher.match(source, header)
        if target is not None:
            self._deliver(source, header, target, self._p2p_frame, _P2P_DATA)
            self._post_p2p_frame()
        elif header[NBYTES] <= INLINE:
            self._matcher.keep(source, header, bytes(self._p2p_frame[_HSIZE:_HSIZE + header[NBYTES]]))
            self._post_p2p_frame()
        else:
            # Nobody waits for it yet: read it into memory, and only then the next frame,
            # so that a later message of this sender cannot overtake it.
            buffer = bytearray(header[NBYTES])

            def landed(_source: int) -> None:
                target = self._matcher.match(source, header)
                if target is not None:
                    deliver_early(self, target, header, buffer)
                else:
                    self._matcher.keep(source, header, bytes(buffer))
                self._post_p2p_frame()
            self._post(self.comm.Irecv([buffer, self._mpi.BYTE], source, _P2P_DATA), landed, None, buffer)
        self._need(state)

    def _deliver(self, source: int, header: tuple, target: Transfer, frame: bytearray, data_tag: int) -> None:
        """Check a matched frame against its receive; copy an inline payload, or post the
        receive of a separate one straight into the destination."""
        try:
            check_match(self.label, self.names, self.rank, target, source, header)
        except DistBackendError as exc:
            self.fail(exc)
            target.finish(exc)
            return
        nbytes = target.nbytes
        if nbytes <= INLINE:
            target.view[:] = frame[_HSIZE:_HSIZE + nbytes]
            _landed(target)
        else:
            self._post(self.comm.Irecv([target.view, self._mpi.BYTE], source, data_tag), _landed, target,
                       target.view)

    def _on_ctrl_frame(self, source: int) -> None:
        header = _unpack_from(self._ctrl_frame, 0)
        payload = bytes(self._ctrl_frame[_HSIZE:_HSIZE + header[NBYTES]])
        self._post_ctrl_frame()
        state = self._peers[source]
        if header[KIND] == MsgKind.ABORT:
            # What the others sent already may finish the current op (an op whose
            # transfers all finish succeeds; see base.Transport.wait): take it first.
            self._poll()
            self.fail(DistBackendError(f"{self.label}: rank {self.names[self.rank]}: the group was aborted by "
                                       f"rank {self.names[source]}: {payload.decode('utf-8', 'replace')}"))
        elif header[KIND] == MsgKind.WAITING:
            self._chains.heard(source, header[SEQ], payload)
        elif header[KIND] == MsgKind.LEFT:
            state.left = _COUNTS.unpack(payload)
            self._need(state)
            self._need_any()

    # -- failure -----------------------------------------------------------------------
    def _need(self, state: _Peer, sending: bool = False) -> None:
        """Fail if ``state``'s peer is gone and something still waits on it: a receive from
        it, a new send to it (``sending``), or, ``_LEFT_GRACE_S`` later, a send to it still
        under way (one it took before leaving may not have seen its end yet here)."""
        if self._error is not None or not state.gone():
            return
        peer = state.peer
        if sending or self._matcher.coll_posted[peer] or any(t.peer == peer for t in self._matcher.p2p_posted):
            self.fail(self._lost(peer, "with nothing more to send to"))
        elif peer not in self._departing and any(t.peer == peer and not t.done for t in self._sending()):
            self._departing[peer] = time.monotonic() + _LEFT_GRACE_S

    def _check_departing(self) -> None:
        """Fail if a send to a peer that left is still under way after the grace period."""
        now = time.monotonic()
        for peer, deadline in list(self._departing.items()):
            if now < deadline:
                continue
            del self._departing[peer]
            if self._error is None and any(t.peer == peer and not t.done for t in self._sending()):
                self.fail(self._lost(peer, "without receiving what it was sent by"))

    def _lost(self, peer: int, what: str) -> DistNetworkError:
        name, me = self.names[peer], self.names[self.rank]
        return DistNetworkError(
            f"{self.label}: rank {me} lost rank {name}: it left the group (destroyed it or is exiting) {what} "
            f"rank {me}. Every rank must call the same collectives and matching sends/recvs before it leaves; "
            f"see rank {name}'s log.")

    def _need_any(self) -> None:
        """Fail if an any-source receive waits and every peer is gone."""
        peers = [s for s in self._peers if s is not None]
        if (self._error is not None or not all(s.gone() for s in peers)
                or not any(t.peer is None for t in self._matcher.p2p_posted)):
            return
        self.fail(DistNetworkError(
            f"{self.label}: rank {self.names[self.rank]}'s receive from any source can never complete: every "
            f"peer, ranks {[self.names[s.peer] for s in peers]}, left the group."))

    def fail(self, error: BaseException, notify: bool = True) -> None:
        if self._error is not None:
            return
        self._error = error
        logger.debug("%s: rank %d broken: %s", self.label, self.names[self.rank], error)
        if notify:
            reason = str(error).encode("utf-8", "replace")[:_CTRL_PAYLOAD]
            self._notify(MsgKind.ABORT, lambda peer: reason)
        for transfer in self._matcher.all_posted():
            transfer.finish(error)
        for action in self._actions:
            if action.transfer is not None:
                action.transfer.finish(error)

    def _notify(self, kind: MsgKind, payload_for: Callable[[int], bytes], seq: int = 0) -> None:
        """Send every peer still there a CTRL frame (best effort; ``close`` flushes them)."""
        for state in self._peers:
            if state is None or state.gone():
                continue
            payload = payload_for(state.peer)
            frame = Header(kind, seq, len(payload)).pack() + payload
            self._post(self.comm.Isend([frame, self._mpi.BYTE], state.peer, _CTRL), _ignore, None, frame,
                       is_send=True)

    def close(self) -> None:
        if self._error is None:
            self._error = DistBackendError(f"{self.label}: the transport of rank "
                                           f"{self.names[self.rank]} was closed")
        for transfer in self._matcher.all_posted():
            transfer.finish(self._error)
        self._notify(MsgKind.LEFT, lambda peer: _COUNTS.pack(*self._sent[peer]))
        # Receives are cancelled; sends must complete (the peers take them, or drop them
        # when they close). Either may need a moment (a receive that already matched a
        # message finishes taking it), so they get ``_FLUSH_S``, without blocking in MPI.
        for request, action in zip(self._requests, self._actions):
            if not action.is_send:
                request.Cancel()
        unfinished = list(zip(self._requests, (action.buffer for action in self._actions)))
        end = time.monotonic() + _FLUSH_S
        while unfinished and time.monotonic() < end:
            unfinished = [(r, b) for r, b in unfinished if not r.Test()]
            if unfinished:
                time.sleep(0.001)
        _LINGERING[:] = [(r, b) for r, b in _LINGERING if not r.Test()] + unfinished
        self._requests, self._actions = [], []


def _landed(transfer: Transfer) -> None:
    """A receive's payload arrived whole."""
    if transfer.on_data is not None:
        transfer.on_data(transfer.nbytes)
    transfer.finish()


def _countdown(countdown: list[int]) -> Callable[[Transfer], None]:
    """A send handler that finishes the transfer at the last of its messages."""
    def handler(transfer: Transfer) -> None:
        countdown[0] -= 1
        if countdown[0] == 0:
            transfer.finish()
    return handler


def _ignore(_source: int) -> None:
    """A control notice we sent went out."""
