"""Matching arriving messages to posted receives; shared by every transport.

Rules (the same for TCP, loopback and shared memory):

- COLL messages from one peer are matched, in order, to the collective receives
  posted for that peer, oldest first. The message must carry the receiver's
  sequence number, fingerprint and byte count; otherwise the ranks disagree about
  the op and :func:`mismatch_error` names both ops, both ranks and the seq.
- A COLL message with no receive posted yet means the peer is ahead. The
  transport *parks* that peer (stops reading it, so the data waits in the
  kernel and the sender is throttled) until a receive is posted. Only when the
  peer hangs up does the transport drain parked messages into ``coll_early``.
  Unless it *contradicts* a receive posted for another peer, or a collective
  send still under way (:func:`contradicts`): of the same op with another
  fingerprint, or of an op this rank has finished. Then the ranks disagree, and
  waiting would only end at the timeout: the receiver may expect nothing from
  that peer, and the peer something from it. (A rank that only sends in an op,
  such as a broadcast's root, posts no receive: two ranks that both believe they
  are the root would each park the other's message while their large sends wait.)
  (TCP and shared memory check this; the loopback, a test double on which the
  algorithms' tests run matched ops only, just parks.)
- P2P messages match the oldest posted P2P receive with the same tag whose source
  is the sender or "any". Unmatched ones are kept whole in arrival order
  (``p2p_early``), so they are never mistaken for collective traffic and later
  receives find them.
- ABORT messages carry the reason a peer broke the group.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from ..errors import DistBackendError
from .base import Transfer
from .framing import Header, MsgKind

__all__ = ["Matcher", "mismatch_error", "check_match", "contradicts", "refuse_contradicting", "refuse_parked",
           "receive_early", "deliver_early", "KIND", "SEQ", "TAG", "NBYTES"]

# Positions in a header's field tuple (see framing.HEADER).
KIND, SEQ, TAG, NBYTES = 0, 5, 6, 8


def mismatch_error(label: str, me: str, mine: Transfer, peer: str, header: Header) -> DistBackendError:
    """The error for a collective message that does not match the receiver's op."""
    ours = f"collective #{mine.seq} {mine.fingerprint.describe()}"
    theirs = f"collective #{header.seq} {header.fingerprint.describe()}"
    if header.kind is MsgKind.COLL and header.seq == mine.seq and header.fingerprint == mine.fingerprint:
        detail = (f"both ranks are at {ours}, but rank {peer} sent {header.nbytes} bytes where rank {me} "
                  f"expects {mine.nbytes} (sizes differ across ranks)")
    else:
        detail = f"rank {me} is at {ours} but rank {peer} sent a message of {theirs}"
    return DistBackendError(
        f"{label}: collective mismatch at sequence number {mine.seq}: {detail}. Every rank must call the "
        "same collectives, in the same order, with the same dtype, element count, root and reduce op."
    )


def contradicts(transfer: Transfer, header: tuple) -> bool:
    """Whether the COLL message ``header`` from one peer shows that its sender is in
    another op than the COLL receive ``transfer`` posted for another peer: the same
    sequence number with another fingerprint (kind, dtype, count, root, reduce op;
    byte counts may differ between peers), or an earlier sequence number (an op
    this rank finished without needing the message)."""
    key = transfer.key
    return header[SEQ] < key[SEQ] or (header[SEQ] == key[SEQ] and (header[1:SEQ] != key[1:SEQ]
                                                                   or header[7] != key[7]))


class Matcher:
    """Posted receives and early arrivals of one rank; driven by one thread."""

    def __init__(self, size: int) -> None:
        self.coll_posted: list[deque[Transfer]] = [deque() for _ in range(size)]
        # Filled only while draining a peer that hung up, or while a P2P receive could be
        # behind a collective message (``p2p_waits_on``): (header, payload).
        self.coll_early: list[deque[tuple[tuple, bytes]]] = [deque() for _ in range(size)]
        self.p2p_posted: list[Transfer] = []
        self.p2p_early: deque[tuple[int, tuple, bytes]] = deque()

    def post(self, transfer: Transfer) -> tuple[tuple, bytes] | None:
        """Register a receive. Returns an early (header fields, payload) it must consume now.

        Headers travel as the tuple ``HEADER.unpack`` gives (kind, op, dtype, redop,
        root, seq, tag, numel, nbytes, ...): comparing tuples is the cheap path."""
        if transfer.kind is MsgKind.COLL:
            early = self.coll_early[transfer.peer]
            if early:
                return early.popleft()
            self.coll_posted[transfer.peer].append(transfer)
            return None
        for index, (src, header, payload) in enumerate(self.p2p_early):
            if header[TAG] == transfer.tag and transfer.peer in (None, src):
                del self.p2p_early[index]
                transfer.source = src
                return header, payload
        self.p2p_posted.append(transfer)
        return None

    def keep(self, peer: int, header: tuple, payload: bytes) -> None:
        """Store a message that arrived before its receive, for ``post`` to hand over."""
        if header[KIND] == MsgKind.COLL:
            self.coll_early[peer].append((header, payload))
        else:
            self.p2p_early.append((peer, header, payload))

    def match(self, peer: int, header: tuple) -> Transfer | None:
        """The posted receive for an arriving COLL/P2P header, or None (COLL: park; P2P: keep)."""
        if header[KIND] == MsgKind.COLL:
            posted = self.coll_posted[peer]
            return posted.popleft() if posted else None
        tag = header[TAG]
        for index, transfer in enumerate(self.p2p_posted):
            if transfer.tag == tag and transfer.peer in (None, peer):
                del self.p2p_posted[index]
                transfer.source = peer
                return transfer
        return None

    def contradicted(self, header: tuple) -> Transfer | None:
        """A posted COLL receive that the unmatched COLL message ``header`` contradicts."""
        for queue in self.coll_posted:
            for transfer in queue:
                if contradicts(transfer, header):
                    return transfer
        return None

    def pending(self) -> bool:
        return bool(self.p2p_posted) or any(self.coll_posted)

    def p2p_waits_on(self, peer: int) -> bool:
        """Whether a posted P2P receive could take a message from ``peer``. A collective
        message of ``peer`` nobody waits for yet is then read into memory instead of
        parked: the P2P message may be queued behind it (the peer sent its part of a
        collective, then the send that we need before we join that collective)."""
        return any(t.peer is None or t.peer == peer for t in self.p2p_posted)

    def all_posted(self) -> list[Transfer]:
        posted = [t for queue in self.coll_posted for t in queue] + self.p2p_posted
        for queue in self.coll_posted:
            queue.clear()
        self.p2p_posted = []
        return posted


def check_match(label: str, names: list[int], rank: int, transfer: Transfer, peer: int,
                header: tuple) -> None:
    """Raise if ``header`` (fields, from ``peer``) is not the message ``transfer`` waits for."""
    if header[KIND] == MsgKind.COLL:
        if header[:9] != transfer.key:  # seq, fingerprint and size at once
            raise mismatch_error(label, str(names[rank]), transfer, str(names[peer]),
                                 Header.from_fields(header))
    elif header[NBYTES] > transfer.nbytes:
        raise DistBackendError(
            f"{label}: rank {names[peer]} sent {header[NBYTES]} bytes with tag {header[TAG]} but rank "
            f"{names[rank]}'s recv has room for {transfer.nbytes} bytes; the recv tensor must be at least "
            "as large as the sent one (usually: the same size and dtype)."
        )
    elif header[NBYTES] < transfer.nbytes:
        # As gloo: a receive larger than the message takes it into its leading bytes
        # (the rest of the tensor keeps its values); the transfer shrinks to the message.
        transfer.view = transfer.view[:header[NBYTES]]
        transfer.nbytes = header[NBYTES]


def _contradiction_error(transport, transfer: Transfer, peer: int, header: tuple) -> DistBackendError:
    return mismatch_error(transport.label, str(transport.names[transport.rank]), transfer,
                          str(transport.names[peer]), Header.from_fields(header))


def refuse_contradicting(transport, matcher: Matcher, peer: int, header: tuple,
                         sends: Iterable[Transfer] = ()) -> bool:
    """When a COLL message from ``peer`` finds no receive posted for it: if it contradicts
    one posted for another peer, or one of the sends still under way, ``sends``, break
    ``transport`` (``label``, ``names``, ``rank``, ``fail``) and return True."""
    clash = matcher.contradicted(header)
    if clash is None:
        clash = next((t for t in sends if t.kind is MsgKind.COLL and not t.done and contradicts(t, header)), None)
    if clash is not None:
        transport.fail(_contradiction_error(transport, clash, peer, header))
    return clash is not None


def refuse_parked(transport, transfer: Transfer, parked: Iterable[tuple[int, tuple]]) -> None:
    """When COLL receive or send ``transfer`` is posted: if a message parked before it,
    ``(peer, header)``, contradicts it, break ``transport`` and raise (it fails a receive
    too). A parked message from a receive's own peer is checked in full when it is
    matched to it instead; a send's peer may post no receive for it in this op at all."""
    for peer, header in parked:
        if (transfer.is_send or peer != transfer.peer) and contradicts(transfer, header):
            transport.fail(_contradiction_error(transport, transfer, peer, header))
            raise transport.error


def receive_early(transport, matcher: Matcher, transfer: Transfer) -> bool:
    """Post receive ``transfer`` to ``transport``'s ``matcher``. If a P2P message for it was
    read into memory before it was posted, complete it with that now (raising if the two
    mismatch) and return True; otherwise the transport goes on to wait for the message."""
    early = matcher.post(transfer)
    if early is None:
        return False
    deliver_early(transport, transfer, *early)
    if transfer.error is not None:
        raise transfer.error
    return True


def deliver_early(transport, transfer: Transfer, header: tuple, payload: bytes | memoryview) -> None:
    """Complete a receive with a message already read into memory. On a mismatch, break
    ``transport`` (a TCP or shared-memory transport: ``label``, ``names``, ``rank``,
    ``fail``) and fail ``transfer``, which, matched, is no longer posted for ``fail`` to see."""
    try:
        check_match(transport.label, transport.names, transport.rank, transfer, transfer.source, header)
    except DistBackendError as exc:
        transport.fail(exc)
        transfer.finish(exc)
        return
    transfer.view[:] = payload
    if transfer.on_data is not None:
        transfer.on_data(transfer.nbytes)
    transfer.finish()
