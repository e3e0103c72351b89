"""The round protocol of the c10d and static backends, with several agents as threads of one process."""

from __future__ import annotations

import threading
import time

import pytest

from torchdist.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousParameters,
    RendezvousSettings,
    RendezvousStateError,
    RendezvousTimeoutError,
    get_rendezvous_handler,
    parse_endpoint,
)
from torchdist.testing import free_port

pytestmark = pytest.mark.timeout(30)

FAST = {"last_call_timeout": "0.3", "keep_alive_interval": "0.1", "keep_alive_max_attempt": "2",
        "join_timeout": "10", "secret": "rdzv-secret"}


def _handler(port, min_nodes=1, max_nodes=2, backend="c10d", **conf):
    params = RendezvousParameters(backend=backend, endpoint=f"localhost:{port}", run_id="t", min_nodes=min_nodes,
                                  max_nodes=max_nodes, config={**FAST, **conf})
    return get_rendezvous_handler(params)


def _in_threads(*calls):
    results, errors = [None] * len(calls), []

    def run(i, call):
        try:
            results[i] = call()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    if errors:
        raise errors[0]
    return results


def test_two_nodes_form_one_round_with_distinct_ranks():
    port = free_port()
    a, b = _handler(port, 2, 2), _handler(port, 2, 2)
    try:
        assert a.is_host != b.is_host, "exactly one agent hosts the store"
        ia, ib = _in_threads(lambda: a.next_rendezvous(2), lambda: b.next_rendezvous(3))
        assert {ia.group_rank, ib.group_rank} == {0, 1}
        assert ia.world_size == ib.world_size == ia.group_world_size == 2  # torch's meaning: nodes
        assert ia.num_workers(2) == ib.num_workers(3) == 5
        assert {ia.rank_offset(2), ib.rank_offset(3)} in ({0, 2}, {0, 3})
        assert (ia.master_addr, ia.master_port) == ("localhost", port)
    finally:
        b.shutdown(), a.shutdown()


def test_c10d_ranks_follow_the_sorted_node_ids_so_a_restart_keeps_them():
    # torch sorts the participants' descriptors (address, pid, id); ranks that followed
    # join order swapped when the other node joined first after a restart.
    port = free_port()
    a, b = _handler(port, 2, 2), _handler(port, 2, 2)
    first, second = sorted([a, b], key=lambda h: h.node_id)
    try:
        rounds = []
        for joins_first, joins_last in ((first, second), (second, first)):
            def late(handler=joins_last):
                time.sleep(0.3)  # the other node's slot is taken first
                return handler.next_rendezvous(1)
            early, later = _in_threads(lambda handler=joins_first: handler.next_rendezvous(1), late)
            ranks = {joins_first.node_id: early.group_rank, joins_last.node_id: later.group_rank}
            rounds.append((ranks[first.node_id], ranks[second.node_id]))
            if len(rounds) == 1:
                joins_first.request_restart("second round")
        assert rounds == [(0, 1), (0, 1)]
    finally:
        b.shutdown(), a.shutdown()


def test_late_node_waits_then_joins_the_next_round():
    port = free_port()
    a = _handler(port)
    b = _handler(port)
    try:
        first = a.next_rendezvous(1)  # forms alone after the last call
        assert first.group_world_size == 1
        joined = []
        thread = threading.Thread(target=lambda: joined.append(b.next_rendezvous(1)))
        thread.start()
        deadline = threading.Event()
        for _ in range(100):
            if a.num_nodes_waiting():
                break
            deadline.wait(0.05)
        assert a.num_nodes_waiting() == 1
        second = a.next_rendezvous(1)
        thread.join(10)
        assert second.round == first.round + 1 and second.group_world_size == 2
        assert joined and joined[0].round == second.round
    finally:
        b.shutdown(), a.shutdown()


def test_a_node_that_leaves_is_reported_lost():
    port = free_port()
    a, b = _handler(port, 2, 2), _handler(port, 2, 2)
    try:
        _in_threads(lambda: a.next_rendezvous(1), lambda: b.next_rendezvous(1))
        assert a.lost_nodes() == []
        b.shutdown()
        time.sleep(0.15)  # scans are at most once per keep_alive_interval
        assert a.lost_nodes() == [b.node_id]
    finally:
        a.shutdown()


def test_a_node_whose_heartbeat_stops_is_reported_lost():
    port = free_port()
    a, b = _handler(port, 2, 2), _handler(port, 2, 2)
    try:
        _in_threads(lambda: a.next_rendezvous(1), lambda: b.next_rendezvous(1))
        b._stop.set()  # the node hangs or dies without a word: no "left" key, no more heartbeats
        deadline = time.monotonic() + 3
        while not a.lost_nodes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert a.lost_nodes() == [b.node_id]
    finally:
        b.shutdown(), a.shutdown()


def test_restart_request_and_failure_are_seen_by_every_node():
    port = free_port()
    a, b = _handler(port, 2, 2), _handler(port, 2, 2)
    try:
        _in_threads(lambda: a.next_rendezvous(1), lambda: b.next_rendezvous(1))
        assert b.restart_request() is None
        a.request_restart("workers failed")
        b.request_restart("second request loses")
        assert b.restart_request() == {"reason": "workers failed", "node": a.node_id}
        b.report_failure({"node": b.node_id, "host": "h", "failures": {}})
        assert a.job_failure()["node"] == b.node_id and a.is_closed()
        with pytest.raises(RendezvousClosedError):
            a.next_rendezvous(1)
    finally:
        b.shutdown(), a.shutdown()


def test_static_ranks_come_from_node_rank():
    port = free_port()
    n0 = _handler(port, 2, 2, backend="static", rank="0")
    n1 = _handler(port, 2, 2, backend="static", rank="1")
    try:
        i1, i0 = _in_threads(lambda: n1.next_rendezvous(1), lambda: n0.next_rendezvous(1))
        assert (i0.group_rank, i1.group_rank) == (0, 1) and n0.is_host and not n1.is_host
    finally:
        n1.shutdown(), n0.shutdown()


def test_static_duplicate_node_rank_is_an_error():
    port = free_port()
    n0 = _handler(port, 2, 2, backend="static", rank="0")
    dup = _handler(port, 2, 2, backend="static", rank="1")
    dup._node_rank = 0  # two launchers given the same --node-rank
    try:
        with pytest.raises(RendezvousStateError, match="distinct --node-rank"):
            _in_threads(lambda: n0.next_rendezvous(1), lambda: dup.next_rendezvous(1))
    finally:
        dup.shutdown(), n0.shutdown()


def test_round_that_cannot_form_times_out():
    a = _handler(free_port(), 2, 2, join_timeout="0.5")
    try:
        with pytest.raises(RendezvousTimeoutError, match="1 node\\(s\\) joined, 2 needed"):
            a.next_rendezvous(1)
    finally:
        a.shutdown()


def test_settings_are_validated_and_endpoints_parsed():
    params = RendezvousParameters("c10d", "h:1", "r", 1, 2, config={"timeout": "7", "is_host": "false"})
    settings = RendezvousSettings.from_parameters(params)
    assert settings.join_timeout == 7 and settings.is_host is False
    with pytest.raises(ValueError, match="keep_alive_interval"):
        RendezvousSettings(keep_alive_interval=0)
    with pytest.raises(ValueError, match="greater than or equal"):
        RendezvousParameters("c10d", "h:1", "r", 3, 2)
    assert parse_endpoint("node0:29401", 29400) == ("node0", 29401)
    assert parse_endpoint("node0", 29400) == ("node0", 29400)
    assert parse_endpoint("[::1]:5", 29400) == ("::1", 5)
    with pytest.raises(ValueError, match="not registered"):
        get_rendezvous_handler(RendezvousParameters("etcd", "h:1", "r", 1, 1))
