"""Conformance of every transport to ``torchdist._transport.base.Transport``.

The same tests run against the loopback transport and against TCP (a mesh of
socketpairs, one thread per rank, in this process): matching by tag and source,
early arrivals, a peer one op ahead, simultaneous large transfers, mismatches
and aborts reaching every rank, timeouts and hang-ups.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable

import pytest
import torch

from torchdist._algorithms.comm import byte_view
from torchdist._transport.base import EMPTY, PeerTimeout, Transport
from torchdist._transport.framing import MsgKind, OpFingerprint, OpKind
from torchdist._transport.loopback import LoopbackFabric
from torchdist._transport.tcp import TcpTransport
from torchdist.errors import DistBackendError, DistError

FP = OpFingerprint.of(OpKind.ALLREDUCE, torch.float32, 4, -1, 0)
NONE = OpFingerprint()


def _tcp_world(size: int) -> list[Transport]:
    pairs = {}
    for a in range(size):
        for b in range(a + 1, size):
            sa, sb = socket.socketpair()
            sa.setblocking(False)
            sb.setblocking(False)
            pairs[a, b], pairs[b, a] = sa, sb
    return [TcpTransport(r, size, {p: pairs[r, p] for p in range(size) if p != r}) for r in range(size)]


def _loopback_world(size: int) -> list[Transport]:
    return LoopbackFabric(size, piece=1000).transports


@pytest.fixture(params=["loopback", "tcp"])
def world(request) -> Callable[[int], list[Transport]]:
    made: list[list[Transport]] = []

    def make(size: int) -> list[Transport]:
        transports = _loopback_world(size) if request.param == "loopback" else _tcp_world(size)
        made.append(transports)
        return transports
    yield make
    for transports in made:
        for t in transports:
            t.close()


def _threads(transports: list[Transport], fn: Callable[[Transport, int], object], timeout: float = 20) -> list:
    results: list = [None] * len(transports)

    def go(rank: int) -> None:
        try:
            results[rank] = fn(transports[rank], rank)
        except BaseException as exc:  # noqa: BLE001 - returned for the test to inspect
            results[rank] = exc
    threads = [threading.Thread(target=go, args=(r,), daemon=True) for r in range(len(transports))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


def _deadline(seconds: float = 10) -> float:
    return time.monotonic() + seconds


def test_p2p_matches_by_tag_and_any_source(world) -> None:
    ts = world(3)

    def fn(t: Transport, rank: int):
        if rank == 0:
            out = []
            for tag in (2, 1):  # posted in the opposite order of arrival
                buf = torch.zeros(2)
                tr = t.irecv(1, MsgKind.P2P, 0, NONE, byte_view(buf), tag)
                t.wait([tr], _deadline())
                out.append(buf[0].item())
            any_buf = torch.zeros(1)
            tr = t.irecv(None, MsgKind.P2P, 0, NONE, byte_view(any_buf), 5)
            t.wait([tr], _deadline())
            return out, tr.source, any_buf.item()
        if rank == 1:
            a, b = torch.full((2,), 1.0), torch.full((2,), 2.0)
            t.wait([t.isend(0, MsgKind.P2P, 0, NONE, byte_view(a), 1),
                    t.isend(0, MsgKind.P2P, 0, NONE, byte_view(b), 2)], _deadline())
            return None
        x = torch.full((1,), 7.0)
        t.wait([t.isend(0, MsgKind.P2P, 0, NONE, byte_view(x), 5)], _deadline())
    results = _threads(ts, fn)
    assert results[0] == ([2.0, 1.0], 2, 7.0)


def test_zero_byte_message_that_arrives_before_its_receive(world) -> None:
    # A barrier's empty message may land before the receive is posted: delivering it
    # then must not write into a read-only buffer.
    ts = world(2)

    def fn(t: Transport, rank: int):
        if rank == 0:
            t.wait([t.isend(1, MsgKind.P2P, 0, NONE, EMPTY, 3),
                    t.isend(1, MsgKind.P2P, 0, NONE, byte_view(torch.ones(1)), 4)], _deadline())
            return None
        later = torch.zeros(1)
        t.wait([t.irecv(0, MsgKind.P2P, 0, NONE, byte_view(later), 4)], _deadline())  # reads tag 3 early
        early = t.irecv(0, MsgKind.P2P, 0, NONE, EMPTY, 3)
        t.wait([early], _deadline())
        return early.done, later.item()
    assert _threads(ts, fn) == [None, (True, 1.0)]


def test_peer_one_op_ahead_and_large_simultaneous_exchange(world) -> None:
    ts = world(2)
    n = 2 << 20  # 8 MiB each way, far beyond socket buffers

    def fn(t: Transport, rank: int):
        peer = 1 - rank
        out = []
        for seq in range(3):
            mine = torch.full((n,), float(rank * 10 + seq))
            got = torch.empty(n)
            seen = []
            if rank == 1:
                time.sleep(0.05)  # rank 0 runs ahead into the next op
            r = t.irecv(peer, MsgKind.COLL, seq, FP, byte_view(got), on_data=seen.append)
            s = t.isend(peer, MsgKind.COLL, seq, FP, byte_view(mine))
            t.wait([s, r], _deadline())
            assert seen and seen[-1] == n * 4 and seen == sorted(seen)
            out.append(got[0].item() == peer * 10 + seq and got[-1].item() == peer * 10 + seq)
        return out
    assert _threads(ts, fn) == [[True] * 3, [True] * 3]


@pytest.mark.parametrize("when", ["before_it_arrives", "after_it_was_parked"])
def test_p2p_message_behind_a_collective_message_nobody_waits_for(world, when: str) -> None:
    """A peer sends its part of a collective, then a P2P message that the receiver needs
    before it joins that collective. The collective message, larger than the buffers
    between them, is read into memory so that the P2P message behind it gets through."""
    ts = world(2)
    n = 1 << 20  # 4 MiB
    fingerprint = OpFingerprint.of(OpKind.ALLREDUCE, torch.float32, n, -1, 0)

    def fn(t: Transport, rank: int):
        if rank == 0:
            part = t.isend(1, MsgKind.COLL, 0, fingerprint, byte_view(torch.full((n,), 3.0)))
            message = t.isend(1, MsgKind.P2P, 0, NONE, byte_view(torch.full((4,), 7.0)), 9)
            t.wait([part, message], _deadline())
            return None
        if when == "after_it_was_parked":
            for _ in range(5):  # read the collective's header; nobody waits for it: parked
                t.progress(0.05)
        got = torch.zeros(4)
        t.wait([t.irecv(0, MsgKind.P2P, 0, NONE, byte_view(got), 9)], _deadline())
        part = torch.zeros(n)
        t.wait([t.irecv(0, MsgKind.COLL, 0, fingerprint, byte_view(part))], _deadline())
        return got[0].item(), part[0].item(), part[-1].item()
    assert _threads(ts, fn) == [None, (7.0, 3.0, 3.0)]


def test_mismatch_raises_on_every_rank(world) -> None:
    ts = world(3)

    def fn(t: Transport, rank: int):
        fp = OpFingerprint.of(OpKind.BROADCAST if rank == 2 else OpKind.ALLREDUCE, torch.float32, 4, 0)
        buf = torch.zeros(4)
        transfers = [t.irecv(p, MsgKind.COLL, 0, fp, byte_view(torch.zeros(4))) for p in range(3) if p != rank]
        transfers += [t.isend(p, MsgKind.COLL, 0, fp, byte_view(buf)) for p in range(3) if p != rank]
        t.wait(transfers, _deadline(5))
    results = _threads(ts, fn)
    for exc in results:
        assert isinstance(exc, DistBackendError), exc
        assert "BROADCAST" in str(exc) and "ALLREDUCE" in str(exc), exc


def test_sending_to_a_rank_that_aborted_reports_its_reason(world) -> None:
    """Rank 2 broke on a mismatch and hung up; rank 1 then exchanges with it: rank 1's
    error is rank 2's reason (read before the hang-up), not a bare "rank 2 is gone"."""
    ts = world(3)
    allreduce = OpFingerprint.of(OpKind.ALLREDUCE, torch.float32, 4, 0)
    broadcast = OpFingerprint.of(OpKind.BROADCAST, torch.float32, 4, 0)
    receive = ts[1].irecv(2, MsgKind.COLL, 0, allreduce, byte_view(torch.zeros(4)))  # posted first
    ts[0].isend(2, MsgKind.COLL, 0, allreduce, byte_view(torch.zeros(4)))
    with pytest.raises(DistBackendError):
        ts[2].wait([ts[2].irecv(0, MsgKind.COLL, 0, broadcast, byte_view(torch.zeros(4)))], _deadline(5))
    with pytest.raises(DistBackendError) as info:
        ts[1].wait([receive, ts[1].isend(2, MsgKind.COLL, 0, allreduce, byte_view(torch.zeros(4)))], _deadline(5))
    assert "BROADCAST" in str(info.value) and "ALLREDUCE" in str(info.value), info.value


def test_timeout_names_the_silent_peer_and_does_not_break(world) -> None:
    ts = world(2)
    buf = torch.zeros(1)
    tr = ts[0].irecv(1, MsgKind.COLL, 0, FP, byte_view(buf))
    start = time.monotonic()
    with pytest.raises(PeerTimeout) as info:
        ts[0].wait([tr], time.monotonic() + 0.3)
    assert info.value.peers == [1] and 0.25 < time.monotonic() - start < 3
    assert ts[0].error is None  # the caller decides whether a timeout breaks the group


def test_hang_up_is_fatal_only_when_data_is_still_needed(world) -> None:
    ts = world(2)
    x = torch.full((4,), 3.0)
    ts[1].isend(0, MsgKind.COLL, 0, FP, byte_view(x))  # small: handed over at once
    ts[1].close()  # rank 1 finished and exited: what it sent is still delivered
    got = torch.zeros(4)
    ts[0].wait([ts[0].irecv(1, MsgKind.COLL, 0, FP, byte_view(got))], _deadline())
    assert got.tolist() == [3.0] * 4
    with pytest.raises(DistError, match="lost rank 1"):
        tr = ts[0].irecv(1, MsgKind.COLL, 1, FP, byte_view(got))
        ts[0].wait([tr], _deadline(5))


def test_fail_sends_abort_to_peers(world) -> None:
    ts = world(3)
    ts[0].fail(DistBackendError("rank 0 saw something bad"))

    def fn(t: Transport, rank: int):
        if rank == 0:
            return None
        tr = t.irecv(0, MsgKind.COLL, 0, FP, byte_view(torch.zeros(4)))
        t.wait([tr], _deadline(5))
    results = _threads(ts, fn)
    for exc in results[1:]:
        assert isinstance(exc, DistBackendError) and "aborted by rank 0" in str(exc), exc
        assert "something bad" in str(exc)
