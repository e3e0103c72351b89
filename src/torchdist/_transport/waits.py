"""Naming the rank at fault when a wait times out: WAITING notices and chains of waits.

The ranks a timed-out rank waits on may be waiting themselves (in a ring, each on
its own left neighbour): naming them would blame the wrong rank. So, the first
time its deadline passes, a rank in a collective tells every peer whom it waits
on (a WAITING notice: the op's sequence number and those ranks) and gives the
others slack to time out in turn and tell it theirs (or ABORT, naming whom they
waited on). At the extended deadline it follows the notices from the ranks it
waits on to the ranks where the chains end: those that sent none (not in the op,
or stalled). The message transports (TCP, MPI) share this; each sends and
receives the notices its own way.
"""

from __future__ import annotations

import array
import time
from typing import Callable, Iterable

from .base import PeerTimeout, Transfer
from .framing import MsgKind

__all__ = ["WaitChains", "ABORT_SLACK_S"]

#: How long past its own deadline a waiter gives the peers it waits on, when all of them
#: joined the op, to time out in turn and send the ABORT that names who they wait on:
#: their timeout firing, plus an ABORT's trip, on a loaded machine.
ABORT_SLACK_S = 1.0


class WaitChains:
    """One transport's record of the op it waits in and of its peers' WAITING notices."""

    def __init__(self, rank: int, names: list[int], label: str) -> None:
        self.rank, self.names, self.label = rank, names, label
        self._op_seq, self._op_start = -1, 0.0  # the latest collective waited on, since when
        self._waiting: dict[int, tuple[int, list[int]]] = {}  # peer -> its last WAITING: (seq, ranks)

    @staticmethod
    def owing(transfers: list[Transfer], live_peers: Iterable[int],
              heard_seq: Callable[[int], int]) -> tuple[list[int], list[int]]:
        """The peers of unfinished ``transfers`` (every one of ``live_peers`` for a receive
        from any source), and those of them that sent us a message of the transfer's
        collective or a later one (``heard_seq(p)``: the latest one's seq): they joined it."""
        pending = [t for t in transfers if not t.done]
        peers = {t.peer for t in pending if t.peer is not None}
        if any(t.peer is None for t in pending):
            peers.update(live_peers)
        joined = {t.peer for t in pending if t.kind is MsgKind.COLL and t.peer is not None
                  and heard_seq(t.peer) >= t.seq}
        return sorted(peers), sorted(joined)

    def begin(self, transfers: list[Transfer]) -> None:
        """Called at the top of every ``wait``: note when a collective's first wait began."""
        if transfers and transfers[0].kind is MsgKind.COLL and transfers[0].seq != self._op_seq:
            self._op_seq, self._op_start = transfers[0].seq, time.monotonic()

    def extend(self, transfers: list[Transfer], deadline: float, peers: list[int], joined: list[int],
               heard_at: Callable[[int], float]) -> float | None:
        """At the first passing of ``deadline``: the later deadline to wait for, or None if
        there is no reason to wait (not a collective, and someone owing never joined).

        ``peers`` are the ranks still owing ``transfers`` data, ``joined`` those of them that
        sent a message of the op (``heard_at(p)``: when it came). A rank that joined
        started the op before we heard from it, so its deadline is at most (heard_at -
        our start) after ours: that, plus the full slack, if all did. Otherwise at most
        a quarter of the timeout (a 0.5 s barrier timeout stays well under a second)."""
        if transfers[0].kind is not MsgKind.COLL and not (joined and joined == peers):
            return None
        if joined and joined == peers:
            latest = max(heard_at(p) for p in joined)
            return deadline + max(0.0, latest - self._op_start) + ABORT_SLACK_S
        return deadline + min(ABORT_SLACK_S, 0.25 * (deadline - self._op_start))

    @staticmethod
    def notice(peers: list[int]) -> bytes:
        """A WAITING notice's payload: the group ranks waited on, as int32."""
        return array.array("i", peers).tobytes()

    def heard(self, peer: int, seq: int, payload: bytes) -> None:
        """``peer``'s WAITING notice arrived: in collective ``seq`` it waits on the ranks listed."""
        self._waiting[peer] = (seq, array.array("i", payload).tolist())

    def _culprits(self, seq: int, suspects: list[int]) -> tuple[list[int], list[int]]:
        """Follow the WAITING notices of collective ``seq`` from ``suspects``: the ranks at
        the ends of the chains (they sent none: not in the op, or stalled), and the ranks
        on the way (they wait themselves)."""
        culprits, waiting, frontier = set(), set(), list(suspects)
        while frontier:
            p = frontier.pop()
            if p in culprits or p in waiting or p == self.rank:
                continue
            notice = self._waiting.get(p)
            if notice is not None and notice[0] == seq:
                waiting.add(p)
                frontier.extend(notice[1])
            else:
                culprits.add(p)
        return sorted(culprits) or list(suspects), sorted(waiting)

    def timeout(self, peers: list[int], joined: list[int], seq: int) -> PeerTimeout:
        """The error of a wait that timed out on ``peers`` (``joined``: those in the op)."""
        # Ranks that joined the op, or told us they wait, are waiting themselves: blame the
        # ranks their chains end at, if there are any.
        suspects, waiting = self._culprits(seq, [p for p in peers if p not in joined] or peers)
        if waiting:
            peers, joined = sorted(set(peers) | set(suspects)), sorted(set(joined) | set(waiting))
        suspects = [p for p in peers if p not in joined] or peers
        message = f"{self.label}: timed out waiting for ranks {[self.names[p] for p in suspects]}"
        if joined:
            message += (f"; ranks {[self.names[p] for p in joined]} joined collective #{seq} and are "
                        "probably waiting on other ranks")
        return PeerTimeout(message, suspects, joined)
