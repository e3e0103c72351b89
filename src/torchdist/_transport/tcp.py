"""TCP transport: one non-blocking socket per peer, driven by one thread with ``poll``.

Why one thread and no sender thread: measured on this 2-core VM, a single thread
moving bytes in both directions matched or beat a separate sender thread, and a
thread wake-up costs 30-300 us, more than a small collective takes.

Per peer (:class:`_Channel`):

- *send side*: a FIFO of posted sends. The head message goes out with
  ``sendmsg([header, payload])`` straight from the tensor's memory; a partial
  write leaves ``send_off`` mid-message and asks ``poll`` for POLLOUT.
- *receive side*: a 64 KiB staging buffer. While waiting for a header we read
  into it, which usually brings a small message's header and payload (and
  maybe the next header) in one ``recv``; payload bytes found there are copied
  to the receive's buffer, the rest of a large payload is read with
  ``recv_into`` straight into the tensor.
- *parking*: a COLL header with no matching receive posted means the peer is
  ahead of us. We stop reading that socket (POLLRDHUP only), leaving the data
  in the kernel; posting the receive resumes it. If the peer hangs up while
  parked we drain its messages into memory, so an ABORT behind them is read.
- *early messages*: a P2P message nobody waits for (and a drained COLL one) is
  read into memory; a receive posted while it streams in takes it once it is
  complete (``_early_done``).

OS errors and EOF become :class:`DistNetworkError` here, naming the peer's rank;
the first fatal error breaks the transport (see ``base.Transport``). A dead peer
is fatal once something waits on it (``_need``); an any-source receive, once no
peer is left (``_need_any``). A collective that times out tells its peers whom
it waits on (a WAITING notice) and waits a little longer for theirs, or their
ABORT, to name the rank the chain of waits ends at (``waits.py``).

(Longer than our usual module: the send path, the receive state machine and the
failure handling share the per-channel state and are read together.)
"""

from __future__ import annotations

import logging
import os
import select
import socket
import time
from collections import deque
from typing import Callable, Iterable

from ..errors import DistBackendError, DistNetworkError
from .base import COMPANION_SLICE_S, Transfer, Transport, advance_receive
from .framing import HEADER, Header, MsgKind, OpFingerprint
from .matching import (KIND, NBYTES, SEQ, TAG, Matcher, check_match, deliver_early, receive_early,
                       refuse_contradicting, refuse_parked)
from .waits import WaitChains

__all__ = ["TcpTransport"]

logger = logging.getLogger(__name__)

_STAGE = 65536
#: How long ``wait`` polls without sleeping before it blocks (see ``progress``).
_SPIN_S = float(os.environ.get("TORCHDIST_TCP_SPIN_US", "100")) * 1e-6
_HSIZE = HEADER.size
_unpack_from = HEADER.unpack_from
_IN = select.POLLIN | select.POLLRDHUP
_PARKED = select.POLLRDHUP
_OUT = select.POLLOUT
_HANGUP = select.POLLHUP | select.POLLERR | select.POLLRDHUP | select.POLLNVAL


class _Channel:
    __slots__ = ("peer", "sock", "fd", "sendq", "send_off", "stage", "stage_view", "start", "end",
                 "target", "got", "parked", "draining", "mask", "alive", "lost", "heard_seq", "heard_at")

    def __init__(self, peer: int, sock: socket.socket) -> None:
        self.peer = peer
        self.sock = sock
        self.fd = sock.fileno()
        self.sendq: deque[Transfer] = deque()
        self.send_off = 0
        self.stage = bytearray(_STAGE)
        self.stage_view = memoryview(self.stage)
        self.start = self.end = 0          # unread staged bytes are stage[start:end]
        self.target: Transfer | None = None  # receive whose payload is being read
        self.got = 0                       # payload bytes of target read so far
        self.parked: tuple | None = None  # COLL header fields waiting for a receive
        self.draining = False              # peer hung up: read everything into memory
        self.mask = _IN
        self.alive = True
        self.lost: BaseException | None = None  # why the connection ended (EOFError: hang-up)
        self.heard_seq = -1                # the latest collective the peer sent us a message of,
        self.heard_at = 0.0                # and when its first message of it arrived


class TcpTransport(Transport):
    """The TCP implementation of :class:`~torchdist._transport.base.Transport`."""

    def __init__(self, rank: int, size: int, sockets: dict[int, socket.socket],
                 names: list[int] | None = None, label: str = "tcp") -> None:
        self.rank, self.size = rank, size
        self.names = names if names is not None else list(range(size))
        self.label = label
        self._error: BaseException | None = None
        self._matcher = Matcher(size)
        self._sweeping = False  # inside _read_the_others
        self._chains = WaitChains(rank, self.names, label)  # naming the rank at fault at a timeout
        self._channels: list[_Channel | None] = [None] * size
        self._by_fd: dict[int, _Channel] = {}
        self._poller = select.poll()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller.register(self._wake_r, select.POLLIN)
        for peer, sock in sockets.items():
            channel = _Channel(peer, sock)
            self._channels[peer] = channel
            self._by_fd[channel.fd] = channel
            self._poller.register(channel.fd, channel.mask)

    # -- posting -----------------------------------------------------------------------
    def isend(self, peer: int, kind: MsgKind, seq: int, fingerprint: OpFingerprint,
              payload: memoryview, tag: int = 0) -> Transfer:
        if self._error is not None:
            raise self._error
        transfer = Transfer(True, kind, peer, seq, fingerprint, tag, payload)
        if kind == MsgKind.COLL:
            refuse_parked(self, transfer, self._parked())
        channel = self._channels[peer]
        channel.sendq.append(transfer)
        if not channel.alive:
            self._need(channel)
            raise self._error
        if len(channel.sendq) == 1:
            self._push(channel)  # try at once: a small message leaves without a poll
        return transfer

    def irecv(self, peer: int | None, kind: MsgKind, seq: int, fingerprint: OpFingerprint,
              payload: memoryview, tag: int = 0,
              on_data: Callable[[int], None] | None = None) -> Transfer:
        if self._error is not None:
            raise self._error
        transfer = Transfer(False, kind, peer, seq, fingerprint, tag, payload, on_data)
        if receive_early(self, self._matcher, transfer):
            return transfer
        if peer is None:
            for channel in self._channels:
                if channel is not None and channel.parked is not None:
                    self._unpark(channel)
            self._need_any()
            if self._error is not None:
                raise self._error
        elif not self._channels[peer].alive:
            self._need(self._channels[peer])  # nothing buffered will ever satisfy it
            raise self._error
        else:
            channel = self._channels[peer]
            if kind == MsgKind.COLL:
                refuse_parked(self, transfer, self._parked())
                if channel.parked is not None:  # the peer's message was waiting for a receive
                    header, channel.parked = channel.parked, None
                    self._set_mask(channel)
                    self._dispatch(channel, header)  # matches the receive just posted
                    self._read(channel)
            elif channel.parked is not None:
                self._unpark(channel)
        return transfer

    def _parked(self) -> Iterable[tuple[int, tuple]]:
        return ((c.peer, c.parked) for c in self._channels if c is not None and c.parked is not None)

    # -- driving -----------------------------------------------------------------------
    def wait(self, transfers: Iterable[Transfer], deadline: float | None) -> None:
        transfers = list(transfers)
        self._chains.begin(transfers)
        extended = False
        while True:
            for transfer in transfers:
                if not transfer.done:
                    break
            else:
                break  # all done: a break after that is the next op's (see Transport.wait)
            if self._error is not None:
                raise self._error
            if deadline is None:
                timeout = 1.0
            else:
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    # The ranks we wait on may be waiting themselves: tell every peer whom we
                    # wait on and give them slack to tell us theirs (see waits.py).
                    peers, joined = self._chains.owing(
                        transfers, (c.peer for c in self._channels if c is not None and c.alive),
                        lambda p: self._channels[p].heard_seq)
                    later = None if extended else self._chains.extend(
                        transfers, deadline, peers, joined, lambda p: self._channels[p].heard_at)
                    if later is None:
                        raise self._chains.timeout(peers, joined, transfers[0].seq)
                    if transfers[0].kind is MsgKind.COLL:
                        self._tell_waiting(transfers[0].seq, peers)
                    deadline, extended = later, True
                    continue
            if self.companion is not None:
                self.companion()
                timeout = min(timeout, COMPANION_SLICE_S)
            self.progress(timeout, _SPIN_S)
        for transfer in transfers:
            if transfer.error is not None:
                raise transfer.error

    def _tell_waiting(self, seq: int, peers: list[int]) -> None:
        """Send every live peer a WAITING notice: in collective ``seq`` we wait on ``peers``."""
        payload = memoryview(WaitChains.notice(peers))
        for channel in self._channels:
            if channel is not None and channel.alive:
                self.isend(channel.peer, MsgKind.WAITING, seq, OpFingerprint(), payload)

    def progress(self, timeout: float, spin: float = 0.0) -> None:
        """One round of ``poll``; ``spin`` seconds of polling without sleeping first."""
        if self.on_poll is not None:
            self.on_poll()
        poll = self._poller.poll
        try:
            events = poll(0)
            if not events and spin > 0:
                # A small op's reply usually comes within tens of microseconds. Sleeping
                # in poll() would cost a scheduler wake-up (far more on a busy machine),
                # so poll without blocking a little while, yielding the CPU each round.
                until = time.perf_counter() + spin
                while not events and time.perf_counter() < until:
                    os.sched_yield()
                    events = poll(0)
            if not events:
                events = poll(max(0, int(timeout * 1000 + 0.999)))
        except InterruptedError:
            return
        for fd, event in events:
            channel = self._by_fd.get(fd)
            if channel is None:
                if fd == self._wake_r:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                continue
            if event & _OUT:
                self._push(channel)
            if event & (select.POLLIN | _HANGUP) and channel.alive:
                if channel.parked is not None and event & _HANGUP:
                    self._drain(channel)
                self._read(channel)

    def interrupt(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # already pending, or closed

    def pending(self) -> bool:
        """Posted receives, queued sends, or a message half read: its receive is matched,
        so no longer "posted", but its bytes still stream in (an ``irecv`` posted after
        its message began to arrive)."""
        return self._matcher.pending() or any(c is not None and (c.sendq or c.target is not None)
                                              for c in self._channels)

    # -- sending -----------------------------------------------------------------------
    def _push(self, channel: _Channel) -> None:
        sendq = channel.sendq
        while sendq:
            transfer = sendq[0]
            off = channel.send_off
            if off < HEADER.size:
                parts = [memoryview(transfer.header)[off:], transfer.view]
            else:
                parts = [transfer.view[off - HEADER.size:]]
            try:
                sent = channel.sock.sendmsg(parts)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                self._lost(channel, exc)
                return
            off += sent
            if off < HEADER.size + transfer.nbytes:
                channel.send_off = off
                break
            channel.send_off = 0
            sendq.popleft()
            transfer.finish()
        self._set_mask(channel)

    # -- receiving ---------------------------------------------------------------------
    def _read(self, channel: _Channel) -> None:
        """Read what ``channel`` has, dispatching headers and filling receives.

        One ``recv`` per call unless it filled its buffer: poll is level-triggered,
        so anything left is reported again, and we save the syscall (and the
        exception) of a read that would find nothing.
        """
        sock, view = channel.sock, channel.stage_view
        drained = False  # a recv returned less than asked: the socket is empty for now
        while channel.alive and channel.parked is None and self._error is None:
            target = channel.target
            staged = channel.end - channel.start
            if target is None:
                if staged >= _HSIZE:
                    header = _unpack_from(channel.stage, channel.start)
                    channel.start += _HSIZE
                    self._dispatch(channel, header)
                    continue
                if channel.start:  # compact so a header never straddles the end
                    view[:staged] = view[channel.start:channel.end]
                    channel.start, channel.end = 0, staged
                dest = view[channel.end:]
            else:
                remaining = target.nbytes - channel.got
                if staged:
                    take = staged if staged < remaining else remaining
                    target.view[channel.got:channel.got + take] = view[channel.start:channel.start + take]
                    channel.start += take
                    advance_receive(channel, take)
                    continue
                channel.start = channel.end = 0
                # Large remainders go straight into the destination; small ones through
                # the stage so the next header comes with them.
                dest = target.view[channel.got:] if remaining >= _STAGE else view
            if drained:
                return
            try:
                n = sock.recv_into(dest)
            except BlockingIOError:
                return
            except OSError as exc:
                self._lost(channel, exc)
                return
            if n == 0:
                self._lost(channel, None)
                return
            if dest is view or target is None:
                channel.end += n
            else:
                advance_receive(channel, n)
            drained = n < len(dest)

    def _dispatch(self, channel: _Channel, header: tuple) -> None:
        kind = header[KIND]
        if kind == MsgKind.ABORT or kind == MsgKind.WAITING:
            self._begin_payload(channel, header)
            return
        if kind == MsgKind.COLL and header[SEQ] != channel.heard_seq:
            channel.heard_seq, channel.heard_at = header[SEQ], time.monotonic()  # see wait()
        target = self._matcher.match(channel.peer, header)
        if target is None:
            if kind == MsgKind.COLL and refuse_contradicting(self, self._matcher, channel.peer, header,
                                                             (t for c in self._channels if c is not None
                                                              for t in c.sendq)):
                return  # not ahead: in another op (see matching)
            if kind == MsgKind.COLL and not channel.draining and not self._matcher.p2p_waits_on(channel.peer):
                channel.parked = header  # the peer is ahead: leave its data in the kernel
                self._set_mask(channel)
                return
        else:
            try:
                check_match(self.label, self.names, self.rank, target, channel.peer, header)
            except DistBackendError as exc:
                self.fail(exc)
                return
        self._begin_payload(channel, header, target)

    def _begin_payload(self, channel: _Channel, header: tuple, target: Transfer | None = None) -> None:
        if target is None:  # P2P nobody waits for yet, an ABORT, or draining: keep in memory
            fp = OpFingerprint(header[1], header[2], header[7], header[4], header[3])
            target = Transfer(False, MsgKind(header[KIND]), channel.peer, header[5], fp, header[TAG],
                              memoryview(bytearray(header[NBYTES])))
            target.on_done = self._early_done(channel.peer, header)
        channel.target, channel.got = target, 0
        if target.nbytes == 0:
            advance_receive(channel, 0)

    def _read_the_others(self, aborter: int) -> None:
        """Before an ABORT from ``aborter`` breaks us: read what the other peers have
        already sent. The bytes that finish the current op may sit in another socket,
        and an op whose transfers all finish succeeds (the break is the next op's
        error, see ``wait``); failing it instead made one rank fail an op that every
        other rank completed. No nesting: an ABORT read here breaks us at once."""
        if self._sweeping:
            return
        self._sweeping = True
        try:
            for channel in self._channels:
                if channel is not None and channel.peer != aborter and channel.alive:
                    self._read(channel)
        finally:
            self._sweeping = False

    def _early_done(self, peer: int, header: tuple) -> Callable[[Transfer], None]:
        def done(transfer: Transfer) -> None:
            if header[KIND] == MsgKind.WAITING:
                self._chains.heard(peer, header[SEQ], bytes(transfer.view))
                return
            if header[KIND] == MsgKind.ABORT:
                reason = bytes(transfer.view).decode("utf-8", "replace")
                self._read_the_others(peer)
                # Passed on (notify): a peer that hears of the break from us, before our
                # socket closes, learns its cause instead of only that we went away.
                self.fail(DistBackendError(f"{self.label}: rank {self.names[self.rank]}: the group was "
                                           f"aborted by rank {self.names[peer]}: {reason}"))
                return
            # A receive posted while this payload streamed in found it neither among the
            # early messages nor as a new header: it takes the message now.
            target = self._matcher.match(peer, header)
            if target is not None:
                deliver_early(self, target, header, transfer.view)
            else:
                self._matcher.keep(peer, header, bytes(transfer.view))
        return done

    def _unpark(self, channel: _Channel) -> None:
        """A P2P receive was posted: read the parked collective message into memory, so
        that the receive's message, possibly behind it, can come (see ``Matcher.p2p_waits_on``)."""
        header, channel.parked = channel.parked, None
        self._begin_payload(channel, header)
        self._set_mask(channel)
        self._read(channel)

    def _drain(self, channel: _Channel) -> None:
        """The peer hung up while parked: read its remaining messages into memory."""
        header, channel.parked = channel.parked, None
        channel.draining = True
        self._begin_payload(channel, header)
        self._set_mask(channel)

    # -- failure -----------------------------------------------------------------------
    def _lost(self, channel: _Channel, exc: OSError | None) -> None:
        """The peer hung up (EOF) or the connection failed.

        Not fatal by itself: a peer that finished its last op and exited has sent
        all we need, and it may be sitting in our buffers. It is fatal once we
        need more from that peer, or need to send to it (``_need``).
        """
        channel.alive = False
        channel.lost = exc if exc is not None else EOFError()
        try:
            self._poller.unregister(channel.fd)  # level-triggered HUP would spin otherwise
        except (KeyError, ValueError):
            pass
        self._need(channel)
        self._need_any()

    def _need(self, channel: _Channel) -> None:
        """Fail if ``channel`` is dead and something still waits on it."""
        if channel.alive or self._error is not None:
            return
        peer = channel.peer
        if not (channel.target is not None or channel.sendq or self._matcher.coll_posted[peer]
                or any(t.peer == peer for t in self._matcher.p2p_posted)):
            return
        name = self.names[peer]
        if channel.target is not None or channel.end > channel.start:
            # A rank that breaks its group mid-message cannot send an ABORT behind the
            # message: it drops the rest and half-closes (see _send_abort), which lands here.
            cause = (f"Rank {name} died, exited or broke the group in the middle of a message to rank "
                     f"{self.names[self.rank]}; see its log for the cause.")
        else:
            cause = f"Rank {name} most likely died, exited or destroyed the group; see its log for the cause."
        error = DistNetworkError(f"{self.label}: rank {self.names[self.rank]} lost rank {name}: "
                                 f"{self._how_lost(channel)}. {cause}")
        self._fail_lost(error, [channel])

    def _need_any(self) -> None:
        """Fail if an any-source receive waits and every peer is gone: nobody can satisfy it."""
        channels = [c for c in self._channels if c is not None]
        if (self._error is not None or not channels or any(c.alive for c in channels)
                or not any(t.peer is None for t in self._matcher.p2p_posted)):
            return
        names = [self.names[c.peer] for c in channels]
        hows = "; ".join(f"rank {self.names[c.peer]}: {self._how_lost(c)}" for c in channels)
        error = DistNetworkError(
            f"{self.label}: rank {self.names[self.rank]}'s receive from any source can never complete: "
            f"it lost every peer, ranks {names} ({hows}). They most likely died, exited or destroyed "
            "the group; see their logs for the cause.")
        self._fail_lost(error, channels)

    @staticmethod
    def _how_lost(channel: _Channel) -> str:
        exc = channel.lost
        return "it closed the connection" if isinstance(exc, EOFError) else f"the connection failed ({exc})"

    def _fail_lost(self, error: DistNetworkError, channels: list[_Channel]) -> None:
        """Break with ``error``, the OSError that ended one of ``channels`` (if any) as its cause."""
        causes = [c.lost for c in channels if not isinstance(c.lost, EOFError)]
        if causes:
            error.__cause__ = causes[0]
        self.fail(error)

    def fail(self, error: BaseException, notify: bool = True) -> None:
        if self._error is not None:
            return
        self._error = error
        logger.debug("%s: rank %d broken: %s", self.label, self.names[self.rank], error)
        if notify:
            self._send_abort(str(error))
        for transfer in self._matcher.all_posted():
            transfer.finish(error)
        for channel in self._channels:
            if channel is None:
                continue
            if channel.target is not None:
                channel.target.finish(error)
            while channel.sendq:
                channel.sendq.popleft().finish(error)

    def _send_abort(self, reason: str) -> None:
        # Best effort, without blocking: an ABORT can only go out at a message boundary.
        # Mid-message, the half-close alone ends the peer's wait at once: fail() drops the
        # rest of the payload, so the peer reads what the kernel holds, then EOF (_need).
        payload = reason.encode("utf-8", "replace")
        frame = Header(MsgKind.ABORT, 0, len(payload)).pack() + payload  # noqa: off the hot path
        for channel in self._channels:
            if channel is None or not channel.alive:
                continue
            try:
                if channel.send_off == 0:
                    channel.sock.send(frame)
                channel.sock.shutdown(socket.SHUT_WR)  # wakes peers parked on us (POLLRDHUP)
            except OSError:
                pass

    def close(self) -> None:
        if self._error is None:
            self._error = DistBackendError(f"{self.label}: the transport of rank "
                                           f"{self.names[self.rank]} was closed")
        for transfer in self._matcher.all_posted():
            transfer.finish(self._error)
        for channel in self._channels:
            if channel is not None:
                channel.alive = False
                try:
                    self._poller.unregister(channel.fd)
                except (KeyError, ValueError):
                    pass
                channel.sock.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1

    def _set_mask(self, channel: _Channel) -> None:
        mask = _PARKED if channel.parked is not None else _IN
        if channel.sendq:
            mask |= _OUT
        if mask != channel.mask and channel.alive:
            channel.mask = mask
            self._poller.modify(channel.fd, mask)
