"""Edge cases of the TCP transport that the conformance tests do not reach.

- a receive posted while an unexpected message from the same peer streams in;
- an any-source receive once every peer is gone;
- a rank breaking its group while a large message to a peer is mid-payload;
- a stalled rank in a ring, named by the ranks that wait on its neighbours;
- a peer's ABORT read in the same poll as the last bytes of a finished receive.

The in-process tests use real loopback TCP connections and drive the transports
from one thread (``_pump``), so the interleavings they test are deterministic.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import pytest
import torch

import torchdist
from torchdist._algorithms.comm import byte_view
from torchdist._process_group.backends.tcp import TcpBackend
from torchdist._process_group.reduce_op import ReduceOp
from torchdist._transport.framing import MsgKind, OpFingerprint, OpKind
from torchdist._transport.mesh import connect_mesh
from torchdist._transport.tcp import TcpTransport
from torchdist.errors import DistBackendError, DistError, DistNetworkError
from torchdist.testing import run_ranks

NONE = OpFingerprint()
FP = OpFingerprint.of(OpKind.ALLREDUCE, torch.float32, 4, -1, 0)


def _tcp_world(size: int) -> list[TcpTransport]:
    """``size`` transports joined by loopback TCP connections (not socketpairs)."""
    socks: dict[tuple[int, int], socket.socket] = {}
    for a in range(size):
        for b in range(a + 1, size):
            with socket.create_server(("127.0.0.1", 0)) as listener:
                sa = socket.create_connection(listener.getsockname())
                sb, _ = listener.accept()
            for s in (sa, sb):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.setblocking(False)
            socks[a, b], socks[b, a] = sa, sb
    return [TcpTransport(r, size, {p: socks[r, p] for p in range(size) if p != r}) for r in range(size)]


@pytest.fixture
def world():
    made: list[TcpTransport] = []

    def make(size: int) -> list[TcpTransport]:
        made.extend(_tcp_world(size))
        return made[-size:]
    yield make
    for t in made:
        t.close()


def _pump(transports: list[TcpTransport], until, seconds: float = 10.0) -> None:
    """Drive every transport from this thread until ``until()``; fail after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not until():
        assert time.monotonic() < deadline, "the transports made no progress"
        for t in transports:
            t.progress(0)


# -- 1. a receive posted while an unexpected message streams in ----------------------------
@pytest.mark.parametrize("src", [1, None], ids=["from-peer", "any-source"])
def test_recv_posted_while_an_unexpected_message_is_half_read(world, src) -> None:
    t0, t1 = world(2)
    n = 4 << 20  # 16 MiB: far beyond the socket buffers, so it arrives in many reads
    data = torch.arange(n, dtype=torch.float32)
    send = t1.isend(0, MsgKind.P2P, 0, NONE, byte_view(data), tag=7)
    channel = t0._channels[1]  # white box: wait until the header is read but not the payload
    _pump([t1, t0], lambda: channel.target is not None and channel.got > 0)
    assert channel.got < data.nbytes

    got = torch.zeros(n)
    seen: list[int] = []
    recv = t0.irecv(src, MsgKind.P2P, 0, NONE, byte_view(got), tag=7, on_data=seen.append)
    _pump([t1, t0], lambda: send.done and recv.done)
    assert recv.error is None and send.error is None
    assert recv.source == 1
    assert torch.equal(got, data)
    assert seen and seen[-1] == data.nbytes

    # The stream stays in step: the next message goes to the next receive.
    later = torch.zeros(3)
    recv2 = t0.irecv(1, MsgKind.P2P, 0, NONE, byte_view(later), tag=7)
    t1.isend(0, MsgKind.P2P, 0, NONE, byte_view(torch.full((3,), 5.0)), tag=7)
    _pump([t1, t0], lambda: recv2.done)
    assert later.tolist() == [5.0] * 3


# -- 2. an any-source receive once every peer is gone --------------------------------------
@pytest.mark.parametrize("posted", ["before", "after"])
def test_any_source_recv_fails_once_every_peer_is_gone(world, posted) -> None:
    t0, t1, t2 = world(3)
    got = torch.zeros(1)
    recv = t0.irecv(None, MsgKind.P2P, 0, NONE, byte_view(got), tag=3) if posted == "before" else None
    t1.close()
    t2.close()
    start = time.monotonic()
    with pytest.raises(DistNetworkError) as info:
        if recv is None:  # see both hang-ups first, then post
            _pump([t0], lambda: not (t0._channels[1].alive or t0._channels[2].alive))
            t0.irecv(None, MsgKind.P2P, 0, NONE, byte_view(got), tag=3)
        else:
            t0.wait([recv], time.monotonic() + 30)
    assert time.monotonic() - start < 5
    message = str(info.value)
    assert "any source" in message and "ranks [1, 2]" in message, message
    assert t0.error is info.value


def test_any_source_recv_waits_while_one_peer_is_alive(world) -> None:
    t0, t1, t2 = world(3)
    got = torch.zeros(1)
    recv = t0.irecv(None, MsgKind.P2P, 0, NONE, byte_view(got), tag=3)
    t1.close()  # one peer gone, the other may still send
    _pump([t0], lambda: not t0._channels[1].alive)
    assert t0.error is None and not recv.done
    t2.isend(0, MsgKind.P2P, 0, NONE, byte_view(torch.full((1,), 2.0)), tag=3)
    t0.wait([recv], time.monotonic() + 10)
    assert recv.source == 2 and got.item() == 2.0


def _store(rank: int, world: int) -> torchdist.PrefixStore:
    store = torchdist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, is_master=(rank == 0),
                               timeout=timedelta(seconds=30))
    return torchdist.PrefixStore("edge", store)


def _recv_any_after_peers_exit(rank: int, world: int) -> tuple[str, float]:
    backend = TcpBackend(_store(rank, world), rank, world, timedelta(seconds=30), group_name="any")
    backend.barrier().wait()
    if rank != 0:
        backend.shutdown()  # and exit: nobody is left to send to rank 0
        return "", 0.0
    start = time.monotonic()
    try:
        backend.recv(torch.zeros(2), None, 4).wait()
    except DistBackendError as exc:
        return str(exc), time.monotonic() - start
    finally:
        backend.shutdown()
    raise AssertionError("a receive from any source completed with no peer left")


def test_any_source_recv_on_a_backend_whose_peers_exited() -> None:
    message, elapsed = run_ranks(_recv_any_after_peers_exit, 3, timeout=60)[0]
    assert elapsed < 5, (elapsed, message)  # not the group's 30 s timeout
    assert "recv" in message and "any source" in message and "ranks [1, 2]" in message, message


# -- 3. breaking the group while a large message is mid-payload ---------------------------

def _abort_mid_payload(rank: int, world: int, mode: str) -> tuple[str, float]:
    """Rank 0 breaks while sending 256 MiB to rank 1, which either posts the matching
    receive only afterwards (``late``), or meanwhile reads the message into memory
    while it waits for something else (``unposted``)."""
    store = _store(rank, world)
    transport = TcpTransport(rank, world, connect_mesh(store, rank, world, 30, list(range(world)), "edge"),
                             label="edge")
    big = torch.ones(64 << 20)
    if rank == 0:
        store.wait(["ready"])
        send = transport.isend(1, MsgKind.P2P, 0, NONE, byte_view(big), tag=1)
        until = time.monotonic() + (0.5 if mode == "late" else 0.02)
        while time.monotonic() < until:
            transport.progress(0.01)
        assert not send.done, "the message was not mid-payload"
        broke_at = time.time()  # wall clock: compared in rank 1's process
        transport.fail(DistBackendError("rank 0 broke its group on purpose"))
        store.set("failed", repr(broke_at))
        store.wait(["done"])  # keep the process and its sockets alive: only the break may end rank 1's wait
        transport.close()
        return "", 0.0
    if mode == "late":
        store.set("ready", "1")
        store.wait(["failed"])
        recv = transport.irecv(0, MsgKind.P2P, 0, NONE, byte_view(big), tag=1)
    else:
        recv = transport.irecv(0, MsgKind.COLL, 0, FP, byte_view(torch.zeros(4)))
        store.set("ready", "1")
    try:
        transport.wait([recv], time.monotonic() + 60)
    except DistError as exc:
        return str(exc), time.time() - float(store.get("failed"))
    finally:
        store.set("done", "1")
        transport.close()
    raise AssertionError("the receive completed although rank 0 broke mid-payload")


@pytest.mark.parametrize("mode", ["late", "unposted"])
def test_breaking_mid_payload_reaches_the_peer_promptly(mode) -> None:
    message, elapsed = run_ranks(_abort_mid_payload, 2, args=(mode,), timeout=60)[1]
    assert elapsed < 5, (elapsed, message)  # seconds from rank 0's break to rank 1's error
    assert "lost rank 0" in message and "broke the group in the middle of a message" in message, message


# -- 4. a stalled rank in a ring -------------------------------------------------------------
def _ring_stall(rank: int, world: int) -> tuple[str, float]:
    backend = TcpBackend(_store(rank, world), rank, world, timedelta(seconds=1.0), group_name="ring")
    backend.barrier().wait()
    if rank == world - 1:
        time.sleep(4.0)  # never joins the all-reduce in time
        backend.shutdown()
        return "", 0.0
    # Rank 1 starts first, so its deadline comes first: it must not blame rank 0, which
    # has joined (rank 1 hears from it in the ring's first step) and waits on rank 2.
    if rank == 0:
        time.sleep(0.3)
    start = time.monotonic()
    try:
        backend.allreduce([torch.ones(1 << 16)], ReduceOp.SUM).wait()
    except DistBackendError as exc:
        return str(exc), time.monotonic() - start
    finally:
        backend.shutdown()
    raise AssertionError("a stalled peer did not time out")


def test_ring_stall_names_the_stalled_rank_on_every_rank() -> None:
    results = run_ranks(_ring_stall, 3, timeout=60, env={"TORCHDIST_ALGO_ALLREDUCE": "ring"})
    for rank, (message, elapsed) in enumerate(results[:2]):
        assert "timed out" in message and "ranks [2] did not arrive" in message, (rank, message)
        assert "ranks [0]" not in message, (rank, message)
        assert elapsed < 3.5, (rank, elapsed)


def test_a_break_read_after_the_last_bytes_is_the_next_ops_error() -> None:
    """Rank 1's message arrives, then rank 1 aborts. Rank 0 reads both in one poll, but
    its receive is complete: that wait succeeds, and the break is the next op's error
    (a hierarchical all-reduce failed its last, finished step this way, now and then)."""
    ts = _tcp_world(2)
    try:
        got = torch.zeros(4)
        receive = ts[0].irecv(1, MsgKind.COLL, 0, FP, byte_view(got))
        ts[1].isend(0, MsgKind.COLL, 0, FP, byte_view(torch.full((4,), 5.0)))  # small: in the socket at once
        ts[1].fail(DistBackendError("rank 1 broke after sending"))
        time.sleep(0.2)  # both the data and the ABORT are waiting for rank 0
        ts[0].wait([receive], time.monotonic() + 10)
        assert got.tolist() == [5.0] * 4
        with pytest.raises(DistBackendError, match="broke after sending"):
            ts[0].wait([ts[0].irecv(1, MsgKind.COLL, 1, FP, byte_view(got))], time.monotonic() + 5)
    finally:
        for t in ts:
            t.close()



# -- the mesh bootstrap ----------------------------------------------------------------------

def _mesh_in_thread(store, rank: int, size: int, timeout: float) -> dict:
    """Run ``connect_mesh`` for ``rank`` on a thread; the dict gets "sockets" or "error"."""
    import threading

    outcome: dict = {}

    def run() -> None:
        try:
            outcome["sockets"] = connect_mesh(store, rank, size, timeout, list(range(size)), "mesh-test")
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome["error"] = exc
    outcome["thread"] = threading.Thread(target=run, daemon=True)
    outcome["thread"].start()
    return outcome


def test_mesh_drops_strangers_on_its_port_without_delaying_the_peers() -> None:
    store = torchdist.HashStore()
    acceptor = _mesh_in_thread(store, 0, 2, timeout=20)
    host, _, port = store.get("tcp/addr/0").decode().rpartition(":")
    idle = socket.create_connection((host, int(port)))  # connects and never says a word
    noise = socket.create_connection((host, int(port)))
    noise.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # a full hello's worth of someone else's bytes
    try:
        start = time.monotonic()
        dialer = connect_mesh(store, 1, 2, 20, [0, 1], "mesh-test")
        acceptor["thread"].join(20)
        assert "error" not in acceptor, acceptor.get("error")
        assert time.monotonic() - start < 5
        sock = acceptor["sockets"][1]
        dialer[0].sendall(b"x")
        sock.setblocking(True)
        assert sock.recv(1) == b"x"  # the peer's socket, not a stranger's
    finally:
        for s in [idle, noise, *dialer.values(), *acceptor.get("sockets", {}).values()]:
            s.close()


def test_mesh_of_ranks_started_for_different_group_sizes_raises() -> None:
    store = torchdist.HashStore()
    acceptor = _mesh_in_thread(store, 0, 2, timeout=20)
    dialer = _mesh_in_thread(store, 1, 3, timeout=3)  # waits for a rank 2 that never comes
    acceptor["thread"].join(20)
    dialer["thread"].join(20)
    assert isinstance(acceptor.get("error"), DistNetworkError), acceptor
    assert "group of 3 ranks" in str(acceptor["error"]) and "one of 2" in str(acceptor["error"])
    assert isinstance(dialer.get("error"), DistNetworkError)


class _StoreThatDies(torchdist.HashStore):
    """A store whose server goes away after ``lives`` seconds."""

    def __init__(self, lives: float) -> None:
        super().__init__()
        self._death = time.monotonic() + lives

    def check(self, keys):
        if time.monotonic() > self._death:
            raise DistNetworkError("the server closed the connection")
        return super().check(keys)


def test_mesh_waiting_for_peers_notices_the_store_is_gone() -> None:
    start = time.monotonic()
    acceptor = _mesh_in_thread(_StoreThatDies(lives=0.5), 0, 2, timeout=30)
    acceptor["thread"].join(30)
    assert isinstance(acceptor.get("error"), DistNetworkError), acceptor
    assert "lost the store" in str(acceptor["error"])
    assert time.monotonic() - start < 5
