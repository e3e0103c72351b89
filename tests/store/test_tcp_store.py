"""TCPStore: the conformance suite, plus what only a networked store shows.

- construction: ephemeral ports, busy ports, multi-tenant sharing, waiting for
  workers, a listening fd (S15-S19), unreachable and unresolvable masters (S20);
- timeouts: a wait that times out as the key arrives keeps the stream in step,
  and a blocking ``queue_pop`` that times out never drops a value;
- failures: a server that dies wakes a blocked client at once;
- hostile peers: garbage, truncated frames, huge lengths, wrong magic or version,
  unknown messages: each is dropped and the server keeps serving everyone else;
- scale: 1024 connections at once, and 256 clients over 4 processes doing mixed
  operations with nothing lost;
- parity: ``num_keys``/``list_keys`` counted like torch.distributed.TCPStore;
- the job secret: clients that cannot prove they hold it never reach the table.

Functions that run on ranks are at module level, where ``run_ranks`` finds them.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import pytest

from torchdist._auth import AuthenticationError
from torchdist._store import tcp_server, wire
from torchdist._store.tcp_store import TCPStore
from torchdist._store.wire import HEADER, HELLO_BODY, U32, Op, Status
from torchdist.errors import DistNetworkError, DistStoreError
from torchdist.testing import RanksFailed, free_port, run_ranks

from .conformance import LONG, StoreConformance, later, run_threads

HOST = "127.0.0.1"
SECOND = timedelta(seconds=1)


class TestTCPStoreConformance(StoreConformance):
    internal_keys = 1  # the join counter of a store built with a world size, as in PyTorch

    def make_store(self, tmp_path: Path) -> TCPStore:
        return TCPStore(HOST, 0, world_size=1, is_master=True)


@pytest.fixture
def master() -> Iterator[TCPStore]:
    store = TCPStore(HOST, 0, is_master=True, timeout=LONG)
    yield store
    store.close()


@pytest.fixture
def client(master: TCPStore) -> Iterator[TCPStore]:
    store = TCPStore(HOST, master.port, timeout=LONG)
    yield store
    store.close()


def _refuses_connections(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex((HOST, port)) != 0


# -- construction (S15-S20) -----------------------------------------------------------
def test_port_zero_binds_an_ephemeral_port(master: TCPStore) -> None:
    assert master.port > 0 and master.host == HOST and master.libuvBackend is False
    other = TCPStore(HOST, master.port, timeout=SECOND)
    other.set("k", "v")
    assert master.get("k") == b"v"
    other.close()


def test_world_size_zero_raises() -> None:
    with pytest.raises(ValueError, match="TCPStore world size cannot be 0"):
        TCPStore(HOST, 0, world_size=0, is_master=True)


def test_second_master_on_a_busy_port_raises(master: TCPStore) -> None:
    with pytest.raises(DistNetworkError, match=f"failed to listen on any local network address.*{master.port}"):
        TCPStore(HOST, master.port, is_master=True, timeout=SECOND)
    assert master.add("still", 1) == 1


def test_multi_tenant_masters_share_one_server() -> None:
    first = TCPStore(HOST, 0, is_master=True, multi_tenant=True, timeout=SECOND)
    second = TCPStore(HOST, first.port, is_master=True, multi_tenant=True, timeout=SECOND)
    first.set("k", "shared")
    assert second.get("k") == b"shared"
    first.close()
    assert second.get("k") == b"shared"  # the server outlives one of its users
    port = second.port
    second.close()
    assert _refuses_connections(port)  # ...and stops with the last


def test_server_stops_when_its_last_store_is_garbage_collected() -> None:
    store = TCPStore(HOST, 0, is_master=True, timeout=SECOND)
    port = store.port
    del store
    gc.collect()
    assert _refuses_connections(port)


def test_clone_of_the_master_keeps_the_server_alive() -> None:
    store = TCPStore(HOST, 0, is_master=True, timeout=SECOND)
    port, clone = store.port, store.clone()
    store.set("k", "v")
    del store
    gc.collect()
    assert clone.get("k") == b"v"
    clone.close()
    assert _refuses_connections(port)


def test_master_times_out_waiting_for_workers() -> None:
    start = time.monotonic()
    with pytest.raises(DistStoreError, match=r"Timed out after \d+ seconds waiting for clients\. 1/2 clients joined\."):
        TCPStore(HOST, 0, world_size=2, is_master=True, timeout=timedelta(milliseconds=300))
    assert time.monotonic() - start < 3


def test_master_without_wait_for_workers_returns_at_once() -> None:
    start = time.monotonic()
    store = TCPStore(HOST, 0, world_size=8, is_master=True, wait_for_workers=False, timeout=LONG)
    assert time.monotonic() - start < 1
    store.close()


def test_master_on_a_listening_fd_waits_for_its_workers() -> None:
    listener = socket.create_server((HOST, 0))
    port = listener.getsockname()[1]
    try:
        workers = [lambda: TCPStore(HOST, port, world_size=3, timeout=LONG) for _ in range(2)]
        master_and_workers = run_threads(
            lambda: TCPStore(HOST, port, world_size=3, is_master=True, master_listen_fd=listener.fileno(), timeout=LONG),
            *workers,
        )
        master = master_and_workers[0]
        assert master.port == port
        assert master.num_keys() == 1 and master.list_keys() == []  # the join counter, hidden
        for store in master_and_workers:
            store.close()
    finally:
        listener.close()


def test_clients_with_fixed_or_no_world_size_share_one_server() -> None:
    master = TCPStore(HOST, 0, world_size=5, is_master=True, wait_for_workers=False, timeout=LONG)

    def work(i: int) -> bytes:
        store = TCPStore(HOST, master.port, world_size=5 if i % 2 else None, timeout=LONG)
        store.set(f"key{i}", str(i))
        store.compare_set("first", "", str(i))
        got = store.get(f"key{(i + 1) % 4}")
        store.close()
        return got

    assert run_threads(*[lambda i=i: work(i) for i in range(4)]) == [b"1", b"2", b"3", b"0"]
    master.close()


def test_unreachable_server_raises_network_error_within_the_timeout() -> None:
    port = free_port()
    start = time.monotonic()
    with pytest.raises(DistNetworkError, match=f"{HOST}:{port}") as info:
        TCPStore(HOST, port, timeout=timedelta(milliseconds=500))
    assert time.monotonic() - start < 1.5
    assert isinstance(info.value.__cause__, OSError)


def test_unresolvable_host_raises_network_error_within_the_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(DistNetworkError, match="no.such.host.invalid"):
        TCPStore("no.such.host.invalid", 29500, timeout=timedelta(milliseconds=500))
    assert time.monotonic() - start < 1.5


def test_client_needs_a_port() -> None:
    with pytest.raises(ValueError, match="port"):
        TCPStore(HOST, 0, timeout=SECOND)


def test_closed_store_says_so(client: TCPStore) -> None:
    client.close()
    with pytest.raises(DistNetworkError, match="unusable.*closed"):
        client.get("k")


# -- parity with torch.distributed.TCPStore ---------------------------------------------
def test_num_keys_and_list_keys_match_torch() -> None:
    import torch.distributed as tdist

    def observe(cls) -> list:
        seen = []
        for world_size in (None, 1, 3):
            master = cls(HOST, 0, world_size, True, SECOND, wait_for_workers=False)
            seen.append((master.num_keys(), master.list_keys()))
            worker = cls(HOST, master.port, world_size, False, SECOND)  # joins when sized
            seen.append((master.num_keys(), master.list_keys()))
            master.set("a", "1")
            master.add("b", 2)
            master.compare_set("c", "", "3")
            master.delete_key("a")
            seen.append((master.num_keys(), sorted(master.list_keys())))
            del worker, master
        return seen

    assert observe(TCPStore) == observe(tdist.TCPStore)


# -- timeouts and the cancel protocol ---------------------------------------------------
def test_waits_that_time_out_as_the_key_arrives_keep_the_stream_in_step(master: TCPStore) -> None:
    writer, reader = master.clone(), master.clone()
    rng = random.Random(0)
    outcomes = {"returned": 0, "timed out": 0}
    for i in range(150):  # the key comes around the (kernel-rounded) 10 ms timeout
        key = f"race/{i}"
        timer = threading.Timer(rng.uniform(0.0, 0.03), writer.set, (key, str(i)))
        timer.start()
        try:
            reader.wait([key], timedelta(milliseconds=10))
            outcomes["returned"] += 1
        except DistStoreError:
            outcomes["timed out"] += 1
        timer.join()
        assert reader.get(key) == str(i).encode()  # the next reply is this request's own
        assert reader.add("count", 1) == i + 1
    assert outcomes["returned"] and outcomes["timed out"], outcomes


def test_blocking_pops_that_time_out_never_drop_a_value(master: TCPStore) -> None:
    pusher, popper = master.clone(), master.clone()
    popper.set_timeout(timedelta(milliseconds=1))
    count = 300

    def push() -> None:
        rng = random.Random(1)
        for i in range(count):
            pusher.queue_push("q", str(i))
            time.sleep(rng.uniform(0, 0.002))

    def pop() -> list[bytes]:
        got, deadline = [], time.monotonic() + 20
        while len(got) < count and time.monotonic() < deadline:
            try:
                got.append(popper.queue_pop("q"))
            except DistStoreError:
                pass
        return got

    _, got = run_threads(push, pop, timeout=30)
    assert got == [str(i).encode() for i in range(count)]
    assert master.queue_len("q") == 0


def test_timeout_names_the_keys(client: TCPStore) -> None:
    with pytest.raises(DistStoreError, match=r"timeout after 50ms.*'missing/1', 'missing/2'"):
        client.wait(["missing/1", "missing/2"], timedelta(milliseconds=50))


# -- threads and many clients ----------------------------------------------------------
def test_threads_sharing_one_handle_are_serialized(client: TCPStore) -> None:
    def work(t: int) -> list[bytes]:
        out = []
        for i in range(100):
            client.set(f"t{t}/{i}", f"{t}:{i}")
            out.append(client.get(f"t{t}/{i}"))
            client.add("n", 1)
        return out

    results = run_threads(*[lambda t=t: work(t) for t in range(6)])
    assert results == [[f"{t}:{i}".encode() for i in range(100)] for t in range(6)]
    assert client.get("n") == b"600"


def test_concurrent_adds_from_many_clients_give_the_exact_total(master: TCPStore) -> None:
    handles = [master.clone() for _ in range(32)]
    totals = run_threads(*[lambda h=h: [h.add("n", 3) for _ in range(100)] for h in handles])
    assert master.get("n") == b"9600"
    assert sorted(v for r in totals for v in r) == list(range(3, 9601, 3))
    for handle in handles:
        handle.close()


def test_one_set_releases_many_waiters(master: TCPStore) -> None:
    handles = [master.clone() for _ in range(64)]
    results = run_threads(*[lambda h=h: h.get("go") for h in handles], later(lambda: master.set("go", "now")))
    assert results[:64] == [b"now"] * 64
    for handle in handles:
        handle.close()


def test_server_holds_1024_connections_at_once(master: TCPStore) -> None:
    clients = [TCPStore(HOST, master.port, timeout=LONG) for _ in range(1024)]
    try:
        for client in clients:
            client.add("joined", 1)
        assert all(c.get("joined") == b"1024" for c in clients[::97])
    finally:
        for client in clients:
            client.close()


def test_large_values_round_trip_and_oversized_ones_are_refused(client: TCPStore) -> None:
    big = os.urandom(8 << 20)
    client.set("big", big)
    assert client.get("big") == big
    with pytest.raises(ValueError, match="MiB limit"):
        client.set("huge", b"\0" * wire.MAX_FRAME)
    assert client.get("big")[:16] == big[:16]


def test_a_value_grown_past_the_frame_limit_is_refused_on_get(client: TCPStore) -> None:
    half = b"\0" * (wire.MAX_FRAME // 2 + 1)
    client.append("grown", half)
    client.append("grown", half)  # each append fits a frame; the value no longer does
    with pytest.raises(ValueError, match="MiB limit"):
        client.get("grown")
    assert client.delete_key("grown") and client.add("n", 1) == 1  # still in step


def _mixed_clients(rank: int, world_size: int, port: int, threads: int) -> dict:
    """``threads`` clients in this rank, each one doing every kind of operation."""
    total = world_size * threads

    def one(t: int) -> dict:
        me = rank * threads + t
        store = TCPStore(HOST, port, timeout=timedelta(seconds=30))
        store.set(f"k/{me}", f"v{me}")
        adds = [store.add("total", 1) for _ in range(10)]
        winner = store.compare_set("leader", "", str(me))
        store.wait([f"k/{(me + 1) % total}"])
        got = store.get(f"k/{(me + 7) % total}")
        assert got == f"v{(me + 7) % total}".encode(), got
        store.queue_push("done", str(me))
        store.close()
        return {"adds": adds, "winner": winner}

    results = run_threads(*[lambda t=t: one(t) for t in range(threads)], timeout=50)
    return {"adds": [a for r in results for a in r["adds"]], "winners": [r["winner"] for r in results]}


def test_256_clients_over_4_processes_lose_nothing(master: TCPStore) -> None:
    results = run_ranks(_mixed_clients, 4, args=(master.port, 64), timeout=60)
    adds = sorted(a for r in results for a in r["adds"])
    assert adds == list(range(1, 2561)) and master.get("total") == b"2560"
    winners = {w for r in results for w in r["winners"]}
    assert winners == {master.get("leader")}
    assert master.multi_get([f"k/{i}" for i in range(256)]) == [f"v{i}".encode() for i in range(256)]
    assert sorted(int(master.queue_pop("done")) for _ in range(256)) == list(range(256))


# -- a server that dies -------------------------------------------------------------
def test_in_process_server_shutdown_wakes_a_blocked_client() -> None:
    master = TCPStore(HOST, 0, is_master=True, timeout=LONG)
    waiter = TCPStore(HOST, master.port, timeout=LONG)
    start = time.monotonic()
    errors = run_threads(lambda: pytest.raises(DistNetworkError, waiter.get, "never"), later(master.close, 0.2))
    assert "closed the connection" in str(errors[0].value)
    assert time.monotonic() - start < 3


def _host_then_die(rank: int, world_size: int, port: int) -> None:
    store = TCPStore(HOST, port, is_master=True, timeout=timedelta(seconds=30))
    store.set("up", "1")
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


def test_killed_server_process_wakes_a_blocked_client() -> None:
    port = free_port()
    crashed: list[BaseException] = []

    def host() -> None:
        try:
            run_ranks(_host_then_die, 1, args=(port,), timeout=30)
        except RanksFailed as exc:
            crashed.append(exc)

    thread = threading.Thread(target=host, daemon=True)
    thread.start()
    store = TCPStore(HOST, port, timeout=timedelta(seconds=30))
    assert store.get("up") == b"1"
    start = time.monotonic()
    with pytest.raises(DistNetworkError, match=f"{HOST}:{port}"):
        store.get("never")
    assert time.monotonic() - start < 5  # promptly, not after the 30 s timeout
    thread.join(30)
    assert crashed, "the server's rank should have been reported as killed"
    with pytest.raises(DistNetworkError, match="unusable"):
        store.set("k", "v")


# -- hostile peers --------------------------------------------------------------------
def _raw(port: int) -> socket.socket:
    sock = socket.create_connection((HOST, port), timeout=5)
    return sock


def _hello(sock: socket.socket, version: int = wire.VERSION, magic: int = wire.MAGIC) -> bytes:
    sock.sendall(wire.frame(Op.HELLO, HELLO_BODY.pack(magic, version, 42)))
    reply = b""
    while len(reply) < 4 + wire.HELLO_FRAME_LEN:
        chunk = sock.recv(4096)
        if not chunk:
            break
        reply += chunk
    return reply


def _dropped(sock: socket.socket) -> bool:
    """True when the server closes the connection (EOF or reset) within 5 s."""
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False
    finally:
        sock.close()


HOSTILE = {
    "http request": lambda s: s.sendall(b"GET / HTTP/1.1\r\nHost: store\r\n\r\n"),
    "garbage": lambda s: s.sendall(bytes(range(256)) * 4),
    "wrong magic": lambda s: s.sendall(wire.frame(Op.HELLO, HELLO_BODY.pack(0xDEADBEEF, wire.VERSION, 1))),
    "request before handshake": lambda s: s.sendall(wire.frame(Op.NUM_KEYS) + b"\0" * 16),
    "huge length": lambda s: (_hello(s), s.sendall(U32.pack(0xFFFFFFFF) + b"x" * 100)),
    "zero length": lambda s: (_hello(s), s.sendall(U32.pack(0))),
    "unknown message type": lambda s: (_hello(s), s.sendall(wire.frame(200, b"body"))),
    "malformed body": lambda s: (_hello(s), s.sendall(wire.frame(Op.COMPARE_SET, b"\xff" * 12))),
    "key not utf-8": lambda s: (_hello(s), s.sendall(wire.frame(Op.DELETE_KEY, b"\xff\xfe"))),
    "handshake twice": lambda s: (_hello(s), _hello(s)),
    "authentication without a secret": lambda s: (_hello(s), s.sendall(wire.frame(Op.AUTH, b"n" * 32))),
    "request while waiting": lambda s: (
        _hello(s),
        s.sendall(wire.frame(Op.GET, b"/never") + wire.frame(Op.NUM_KEYS)),
    ),
}


@pytest.mark.parametrize("attack", sorted(HOSTILE))
def test_hostile_peer_is_dropped_and_others_are_served(master: TCPStore, client: TCPStore, attack: str) -> None:
    client.set("before", "1")
    blocked = master.clone()
    waiting = threading.Thread(target=lambda: blocked.wait(["after"]), daemon=True)
    waiting.start()  # a parked waiter must survive the attack
    sock = _raw(master.port)
    HOSTILE[attack](sock)
    assert _dropped(sock)
    client.set("after", "2")
    waiting.join(5)
    assert not waiting.is_alive()
    assert client.get("before") == b"1" and master.get("after") == b"2"
    fresh = TCPStore(HOST, master.port, timeout=SECOND)
    assert fresh.add("fresh", 1) == 1
    fresh.close()
    blocked.close()
    assert master._server.running


def test_silent_connections_are_dropped_after_the_handshake_deadline(master: TCPStore, client: TCPStore,
                                                                      monkeypatch) -> None:
    monkeypatch.setattr(tcp_server, "_HANDSHAKE_S", 0.5)
    silent, half = _raw(master.port), _raw(master.port)
    half.sendall(wire.frame(Op.HELLO, HELLO_BODY.pack(wire.MAGIC, wire.VERSION, 1))[:7])  # never finished
    idle = TCPStore(HOST, master.port, timeout=SECOND)  # past the handshake: may stay idle
    start = time.monotonic()
    assert _dropped(silent) and _dropped(half)
    assert time.monotonic() - start < 3
    time.sleep(0.6)
    assert idle.add("idle", 1) == 1 and client.get("idle") == b"1"
    idle.close()
    assert master._server.running


def test_truncated_frames_then_disconnect_do_not_harm_the_server(master: TCPStore, client: TCPStore) -> None:
    for cut in (1, 3, 5, 9, 20):
        sock = _raw(master.port)
        _hello(sock)
        sock.sendall(wire.key_value(Op.SET, b"/partial", b"v" * 100)[:cut])
        sock.close()
    sock = _raw(master.port)
    sock.sendall(wire.frame(Op.HELLO, HELLO_BODY.pack(wire.MAGIC, wire.VERSION, 1))[:7])
    sock.close()
    assert client.add("n", 1) == 1 and not client.check(["partial"])
    assert master._server.running


def test_incomplete_requests_of_all_clients_are_held_within_a_budget(master: TCPStore, client: TCPStore,
                                                                     monkeypatch) -> None:
    monkeypatch.setattr(tcp_server, "_PARTIAL_BUDGET", 1 << 20)
    frames = {name: wire.key_value(Op.SET, f"/{name}".encode(), name.encode() * (600 << 10)) for name in "abc"}
    socks, held = {}, 0
    for name, part in (("a", 500 << 10), ("b", 500 << 10)):
        socks[name] = _raw(master.port)
        _hello(socks[name])
        socks[name].sendall(frames[name][:part])
        held += part
        deadline = time.monotonic() + 10
        while master._server._partial_bytes < held and time.monotonic() < deadline:
            time.sleep(0.01)  # read by the server before the next client's bytes
        assert master._server._partial_bytes == held
    socks["c"] = _raw(master.port)
    _hello(socks["c"])
    socks["c"].sendall(frames["c"][:100 << 10])  # passes 1 MiB in all
    assert _dropped(socks.pop("c"))
    for name, sock in socks.items():  # the clients within the budget finish their requests
        sock.sendall(frames[name][500 << 10:])
    assert client.get("a") == b"a" * (600 << 10) and client.get("b") == b"b" * (600 << 10)
    assert not client.check(["c"]) and master._server._partial_bytes == 0
    for sock in socks.values():
        sock.close()


def test_version_mismatch_is_answered_then_dropped(master: TCPStore) -> None:
    sock = _raw(master.port)
    reply = _hello(sock, version=wire.VERSION + 1)
    assert reply[4] == Status.ERROR and b"version" in reply
    assert _dropped(sock)


def test_handshake_reply_is_what_the_protocol_says(master: TCPStore) -> None:
    sock = _raw(master.port)
    reply = _hello(sock)
    assert reply == HEADER.pack(wire.HELLO_FRAME_LEN, Status.OK) + HELLO_BODY.pack(wire.MAGIC, wire.VERSION, 42)
    sock.close()


def test_client_rejects_a_server_that_is_not_a_store() -> None:
    listener = socket.create_server((HOST, 0))
    port = listener.getsockname()[1]

    def answer_like_http() -> None:
        conn, _ = listener.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        conn.close()

    server = threading.Thread(target=answer_like_http, daemon=True)
    server.start()
    start = time.monotonic()
    with pytest.raises(DistNetworkError, match="not a torchdist TCPStore"):
        TCPStore(HOST, port, timeout=timedelta(seconds=10))
    assert time.monotonic() - start < 2  # rejected, not retried until the timeout
    server.join(5)
    listener.close()


def test_client_gives_up_on_a_server_that_never_answers_the_handshake(monkeypatch: pytest.MonkeyPatch) -> None:
    """PyTorch's own TCPStore waits for a request it understands: a torchdist program run by
    torchrun finds that store at MASTER_PORT. It raises naming torchrun, instead of waiting
    out the init timeout (30 minutes by default)."""
    import torch.distributed as torch_dist

    from torchdist._store import tcp_store

    monkeypatch.setattr(tcp_store, "_HANDSHAKE_S", 1.0)
    theirs = torch_dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    start = time.monotonic()
    with pytest.raises(DistNetworkError, match="did not answer torchdist's handshake.*torchrun"):
        TCPStore(HOST, theirs.port, timeout=timedelta(seconds=60))
    assert time.monotonic() - start < 10
    del theirs


# -- the job secret ---------------------------------------------------------------------
@pytest.fixture
def secret_master(monkeypatch: pytest.MonkeyPatch) -> Iterator[TCPStore]:
    monkeypatch.delenv("TORCHDIST_SECRET", raising=False)
    store = TCPStore(HOST, 0, is_master=True, timeout=LONG, secret="job-secret")
    yield store
    store.close()


def test_clients_holding_the_secret_are_served(secret_master: TCPStore) -> None:
    client = TCPStore(HOST, secret_master.port, timeout=SECOND, secret=b"job-secret")
    client.set("k", "v")
    clone = client.clone()
    assert clone.get("k") == b"v" and secret_master.get("k") == b"v"
    client.close()
    clone.close()


def test_secret_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHDIST_SECRET", "from-env")
    master = TCPStore(HOST, 0, is_master=True, timeout=SECOND)
    client = TCPStore(HOST, master.port, timeout=SECOND, secret="from-env")
    assert client.add("n", 1) == 1
    plain = TCPStore(HOST, master.port, timeout=SECOND, secret="")  # an empty secret means none
    with pytest.raises(AuthenticationError, match="requires the job secret"):
        plain.get("n")
    client.close()
    master.close()


def test_client_without_the_secret_is_refused_at_its_first_request(secret_master: TCPStore) -> None:
    plain = TCPStore(HOST, secret_master.port, timeout=SECOND)
    plain.set("one-way", "v")  # no reply to read: the refusal waits for the next request
    with pytest.raises(AuthenticationError, match="requires the job secret.*TORCHDIST_SECRET"):
        plain.check(["one-way"])
    with pytest.raises(DistNetworkError, match="unusable"):
        plain.add("n", 1)
    assert not secret_master.check(["one-way"]) and secret_master.num_keys() == 0


def test_client_with_the_wrong_secret_is_refused_at_once(secret_master: TCPStore) -> None:
    start = time.monotonic()
    with pytest.raises(AuthenticationError, match="failed to prove that it holds this job's secret"):
        TCPStore(HOST, secret_master.port, timeout=timedelta(seconds=10), secret="wrong")
    assert time.monotonic() - start < 2  # refused, not retried until the timeout
    assert secret_master.add("still", 1) == 1


def test_client_with_a_secret_refuses_a_server_without_one(master: TCPStore) -> None:
    with pytest.raises(AuthenticationError, match="no job secret"):
        TCPStore(HOST, master.port, timeout=SECOND, secret="job-secret")


def test_wrong_proof_or_skipped_authentication_is_dropped(secret_master: TCPStore) -> None:
    skipper = _raw(secret_master.port)
    assert _hello(skipper)[4] == Status.OK
    skipper.sendall(wire.key_value(Op.SET, b"/stolen", b"v"))  # a request before authenticating
    assert skipper.recv(4096)[4] == Status.UNAUTHENTICATED
    assert _dropped(skipper)
    forger = _raw(secret_master.port)
    _hello(forger)
    forger.sendall(wire.frame(Op.AUTH, b"n" * 32))
    challenge = forger.recv(4096)
    assert challenge[4] == Status.OK and len(challenge) == 5 + 64
    forger.sendall(wire.frame(Op.AUTH, b"p" * 32))  # a proof made without the secret
    assert b"authentication failed" in forger.recv(4096)
    assert _dropped(forger)
    assert not secret_master.check(["stolen"]) and secret_master.add("still", 1) == 1


def test_multi_tenant_stores_must_agree_on_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHDIST_SECRET", raising=False)
    first = TCPStore(HOST, 0, is_master=True, multi_tenant=True, timeout=SECOND, secret="a")
    with pytest.raises(ValueError, match="different job secret"):
        TCPStore(HOST, first.port, is_master=True, multi_tenant=True, timeout=SECOND, secret="b")
    first.close()
