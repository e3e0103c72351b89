"""Rendezvous in rounds over a TCPStore hosted by one agent: the ``c10d`` and ``static`` backends.

The store
---------
One agent hosts a :class:`~torchdist.TCPStore` server at the rendezvous endpoint
(``--rdzv-endpoint``, or ``--master-addr:--master-port`` for ``static``); every agent,
the host included, is a client. ``c10d``: an agent hosts when the endpoint is one of
its own addresses (``is_host`` in ``--rdzv-conf`` overrides), and falls back to
client when another agent on the same machine bound the port first. ``static``:
node rank 0 hosts. The same store is the workers' store (``MASTER_ADDR:MASTER_PORT``,
``TORCHELASTIC_USE_AGENT_STORE=True``); node 0 of each round deletes the keys
the workers of the previous round left, so every attempt starts clean. The store
requires the job secret when one is configured (see :mod:`torchdist._auth`). The
host must outlive the job: if it dies, the others fail with
:class:`RendezvousConnectionError`.

The protocol (keys under ``torchdist/rdzv/<run_id>/``)
------------------------------------------------------
``round`` holds the current round ``r``. A node that formed round ``r`` before and
must re-rendezvous bumps it with ``compare_set(r, r+1)`` (the first one wins, the
others see ``r+1``), then joins::

    slot = add("r<r>/joined", 1) - 1;  set("r<r>/node<slot>", descriptor)
    poll: joined == max_nodes                      -> close the round with max_nodes
          joined >= min_nodes for last_call_timeout -> close it with ``joined``
          (close = compare_set("r<r>/closed", "", n): the first closer decides n)
    slot < n  -> a participant; group rank = place in the sorted (host, node id)s (c10d) or node rank (static)
    slot >= n -> late: add("r<r>/waiting", 1) and wait for round r+1

Node 0 of the round clears the workers' keys, then sets ``r<r>/ready``; the others
wait for it before they start workers. While the round runs, agents coordinate
through ``r<r>/restart`` (a node asks everyone to restart; the first request wins),
``failed`` (the job failed for good; it holds the root cause, and closes the rendezvous), ``r<r>/waiting``
(nodes that want in), heartbeats ``hb/<node>`` (a counter each agent bumps every
``keep_alive_interval``; a participant whose counter stops for
``keep_alive_interval * keep_alive_max_attempt`` is lost) and ``r<r>/left/<node>``
(a node shut down). When its workers succeed, an agent adds one to ``r<r>/done``
and waits for all participants (the exit barrier); then ``closed`` is set, and nodes
still waiting to join leave with :class:`RendezvousClosedError`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import asdict
from typing import Iterator

from ..._store.tcp_store import TCPStore
from ...errors import DistError
from ..events import NodeState, construct_and_record_rdzv_event
from .api import (
    NodeDesc,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousSettings,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

__all__ = ["StoreRendezvousHandler", "is_local_address", "RDZV_PREFIX"]

log = logging.getLogger(__name__)

RDZV_PREFIX = "torchdist/rdzv/"
_POLL = 0.05  # seconds between polls of the round state


def is_local_address(host: str) -> bool:
    """True when ``host`` names this machine (loopback, or an address a socket can bind)."""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return False
    for family, _, _, _, addr in infos:
        if ipaddress.ip_address(addr[0].split("%")[0]).is_loopback:
            return True
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


@contextlib.contextmanager
def _store_errors(doing: str, where: str) -> Iterator[None]:
    """Store failures become RendezvousConnectionError, with the cause kept."""
    try:
        yield
    except DistError as exc:
        raise RendezvousConnectionError(
            f"rendezvous store at {where} failed while {doing}: {exc}. The node hosting it (the "
            "rendezvous endpoint) may have exited; it must stay up for the whole job."
        ) from exc


class StoreRendezvousHandler(RendezvousHandler):
    """Rounds of membership agreed through a TCPStore; ``node_rank >= 0`` makes it the static backend."""

    def __init__(self, *, backend: str, run_id: str, host: str, port: int, min_nodes: int, max_nodes: int,
                 settings: RendezvousSettings, local_addr: str | None = None, node_rank: int = -1,
                 secret: str | None = None) -> None:
        if node_rank >= 0 and min_nodes != max_nodes:
            raise ValueError(f"the static rendezvous needs a fixed number of nodes, got {min_nodes}:{max_nodes}")
        if node_rank >= max_nodes:
            raise ValueError(f"node rank {node_rank} is out of range for {max_nodes} nodes (0..{max_nodes - 1})")
        self._backend = backend
        self._run_id = run_id
        self._min, self._max = min_nodes, max_nodes
        self._settings = settings
        self._node_rank = node_rank
        self._host_addr = local_addr or socket.gethostname()
        self._node_id = f"{socket.gethostname()}_{os.getpid()}_{secrets.token_hex(3)}"
        self._prefix = f"{RDZV_PREFIX}{run_id}/"
        self._round: int | None = None
        self._participants: tuple[NodeDesc, ...] = ()
        self._beats: dict[str, tuple[int, float]] = {}  # node id -> (last heartbeat count, when it changed)
        self._last_scan, self._lost = 0.0, []
        self._heartbeat: threading.Thread | None = None
        self._stop = threading.Event()
        self.is_host = False
        self._store = self._open_store(host, port, secret)
        self.endpoint = (host, self._store.port)

    # -- the store -------------------------------------------------------------------
    def _open_store(self, host: str, port: int, secret: str | None) -> TCPStore:
        wanted = self._settings.is_host
        if wanted is None:
            wanted = self._node_rank == 0 if self._node_rank >= 0 else is_local_address(host)
        timeout = self._settings.read_timeout
        if wanted:
            try:
                store = TCPStore(host, port, None, True, timeout, wait_for_workers=False, secret=secret)
                self.is_host = True
                log.info("hosting the rendezvous store on port %d", store.port)
                return store
            except DistError as exc:
                if self._settings.is_host or self._node_rank == 0 or port == 0:
                    raise RendezvousConnectionError(f"cannot host the rendezvous store on port {port}: {exc}") from exc
                log.info("port %d is taken (another agent on this host hosts the store): joining as a client", port)
        try:
            store = TCPStore(host, port, None, False, self._settings.join_timeout, wait_for_workers=False,
                             secret=secret)
        except DistError as exc:
            raise RendezvousConnectionError(f"cannot reach the rendezvous store at {host}:{port}: {exc}") from exc
        store.set_timeout(timeout)
        return store

    def _k(self, *parts: object) -> str:
        return self._prefix + "/".join(str(p) for p in parts)

    def _rk(self, *parts: object) -> str:
        return self._k(f"r{self._round}", *parts)

    @property
    def _where(self) -> str:
        return f"{self.endpoint[0]}:{self.endpoint[1]}"

    # -- RendezvousHandler -----------------------------------------------------------
    def get_backend(self) -> str:
        return self._backend

    def get_run_id(self) -> str:
        return self._run_id

    @property
    def node_id(self) -> str:
        return self._node_id

    @property
    def max_nodes(self) -> int:
        return self._max

    def next_rendezvous(self, local_world_size: int) -> RendezvousInfo:
        deadline = time.monotonic() + self._settings.join_timeout
        self._record(f"joining the next round with {local_world_size} workers", NodeState.INIT)
        with _store_errors("forming a round", self._where):
            self._start_heartbeat()
            while True:
                if self.is_closed():
                    raise RendezvousClosedError(f"the rendezvous of run {self._run_id!r} is closed: the job finished")
                current = int(self._store.add(self._k("round"), 0))
                if self._round is not None and current <= self._round:
                    current = int(self._store.compare_set(self._k("round"), str(self._round), str(self._round + 1)))
                info = self._join(current, local_world_size, deadline)
                if info is not None:
                    return info
                self._wait_for_round_after(current, deadline)

    def _join(self, r: int, local_world_size: int, deadline: float) -> RendezvousInfo | None:
        key = lambda *parts: self._k(f"r{r}", *parts)  # noqa: E731
        store = self._store
        if store.check([key("closed")]):
            store.add(key("waiting"), 1)
            log.info("round %d formed without this node; waiting for the next round", r)
            return None
        slot = store.add(key("joined"), 1) - 1
        me = NodeDesc(self._node_id, self._host_addr, local_world_size, self._node_rank)
        store.set(key(f"node{slot}"), json.dumps(asdict(me)))
        count = self._await_closed(r, deadline)
        if slot >= count:
            store.add(key("waiting"), 1)
            log.info("round %d formed with %d nodes before this node joined; waiting", r, count)
            return None
        nodes = [NodeDesc(**json.loads(v)) for v in store.multi_get([key(f"node{i}") for i in range(count)])]
        if self._node_rank >= 0:
            ranks = sorted(n.node_rank for n in nodes)
            if ranks != list(range(count)):
                raise RendezvousStateError(
                    f"static rendezvous: the node ranks of the {count} nodes are {ranks}, expected 0..{count - 1}; "
                    "give every launcher a distinct --node-rank"
                )
            nodes.sort(key=lambda n: n.node_rank)
        else:  # as torch's c10d rendezvous: by descriptor, so the same nodes keep their ranks across rounds
            nodes.sort(key=lambda n: (n.host, n.node_id))
        group_rank = next(i for i, n in enumerate(nodes) if n.node_id == self._node_id)
        self._round, self._participants, self._beats, self._last_scan, self._lost = r, tuple(nodes), {}, 0.0, []
        if group_rank == 0:
            self._clear_worker_keys()
            store.set(key("ready"), b"1")
        else:
            store.wait([key("ready")], max(1.0, deadline - time.monotonic()))
        log.info("round %d formed: %d nodes, this node is group rank %d", r, count, group_rank)
        self._record(f"round {r} formed with {count} nodes", NodeState.RUNNING, rank=group_rank)
        return RendezvousInfo(store, group_rank, len(nodes), RendezvousStoreInfo(*self.endpoint), round=r,
                              participants=tuple(nodes))

    def _record(self, message: str, state: NodeState, rank: int | None = None) -> None:
        """A rendezvous event (free unless a program routes ``dynamic_rendezvous`` events somewhere)."""
        construct_and_record_rdzv_event(run_id=self._run_id, message=message, node_state=state,
                                        hostname=self._host_addr, master_endpoint=f"{self.endpoint[0]}:"
                                        f"{self.endpoint[1]}", rank=rank)

    def _await_closed(self, r: int, deadline: float) -> int:
        closed, joined = self._k(f"r{r}", "closed"), self._k(f"r{r}", "joined")
        reached_min_at = None
        while True:
            if self._store.check([closed]):
                return int(self._store.get(closed))
            count = int(self._store.add(joined, 0))
            now = time.monotonic()
            if count >= self._max:
                return int(self._store.compare_set(closed, "", str(self._max)))
            if count >= self._min:
                reached_min_at = reached_min_at or now
                if now - reached_min_at >= self._settings.last_call_timeout:
                    return int(self._store.compare_set(closed, "", str(count)))
            if now > deadline:
                raise RendezvousTimeoutError(
                    f"round {r} of run {self._run_id!r} did not form within {self._settings.join_timeout:g} s: "
                    f"{count} node(s) joined, {self._min} needed. Start the other launchers, or check their "
                    f"--rdzv-endpoint/--master-addr and secret."
                )
            time.sleep(_POLL)

    def _wait_for_round_after(self, r: int, deadline: float) -> None:
        while int(self._store.add(self._k("round"), 0)) <= r:
            if self.is_closed():
                raise RendezvousClosedError(f"the job of run {self._run_id!r} finished before this node could join")
            if time.monotonic() > deadline:
                raise RendezvousTimeoutError(
                    f"waited {self._settings.join_timeout:g} s for a new round of run {self._run_id!r}: the job "
                    f"runs with the maximum of {self._max} nodes, or has not restarted"
                )
            time.sleep(_POLL * 4)

    def _clear_worker_keys(self) -> None:
        """Delete what earlier workers left in the store (everything outside the rendezvous)."""
        stale = [k for k in self._store.list_keys() if not k.startswith(RDZV_PREFIX)]
        for key in stale:
            self._store.delete_key(key)
        if stale:
            log.debug("cleared %d worker keys of the previous round", len(stale))

    # -- heartbeats and membership ---------------------------------------------------
    def _start_heartbeat(self) -> None:
        if self._heartbeat is not None:
            return
        beat_key = self._k("hb", self._node_id)
        self._store.add(beat_key, 1)
        store = self._store.clone()

        def beat() -> None:
            try:
                while not self._stop.wait(self._settings.keep_alive_interval):
                    store.add(beat_key, 1)
            except DistError as exc:
                log.warning("rendezvous heartbeat stopped: %s", exc)
            finally:
                store.close()

        self._heartbeat = threading.Thread(target=beat, name="torchdist-rdzv-heartbeat", daemon=True)
        self._heartbeat.start()

    def num_nodes_waiting(self) -> int:
        if self._round is None or len(self._participants) >= self._max:
            return 0
        with _store_errors("counting waiting nodes", self._where):
            return int(self._store.add(self._rk("waiting"), 0))

    def lost_nodes(self) -> list[str]:
        """Scanned at most once per ``keep_alive_interval`` (a scan costs two requests per participant)."""
        now = time.monotonic()
        if now - self._last_scan < self._settings.keep_alive_interval:
            return self._lost
        self._last_scan = now
        lost = self._lost = []
        with _store_errors("checking heartbeats", self._where):
            for node in self._participants:
                if node.node_id == self._node_id:
                    continue
                if self._store.check([self._rk("left", node.node_id)]):
                    lost.append(node.node_id)
                    continue
                count = int(self._store.add(self._k("hb", node.node_id), 0))
                seen, since = self._beats.get(node.node_id, (None, now))
                if count != seen:
                    self._beats[node.node_id] = (count, now)
                elif now - since > self._settings.lost_after:
                    lost.append(node.node_id)
        return lost

    def request_restart(self, reason: str) -> None:
        request = json.dumps({"reason": reason, "node": self._node_id})
        with _store_errors("requesting a restart", self._where):
            self._store.compare_set(self._rk("restart"), "", request)

    def restart_request(self) -> dict | None:
        return self._read_json("restart")

    def report_failure(self, summary: dict) -> None:
        """Record the job's failure (the first report wins) and close the rendezvous."""
        with _store_errors("reporting a failure", self._where):
            self._store.compare_set(self._k("failed"), "", json.dumps(summary))
            self.set_closed()

    def job_failure(self) -> dict | None:
        with _store_errors("reading the job's failure", self._where):
            if not self._store.check([self._k("failed")]):
                return None
            return json.loads(self._store.get(self._k("failed")))

    def _read_json(self, name: str) -> dict | None:
        if self._round is None:
            return None
        with _store_errors(f"reading {name}", self._where):
            if not self._store.check([self._rk(name)]):
                return None
            return json.loads(self._store.get(self._rk(name)))

    # -- the end ---------------------------------------------------------------------
    def exit_barrier(self, timeout: float | None = None) -> None:
        """Wait until every participant's workers succeeded (or one failed or left); then close."""
        timeout = self._settings.close_timeout if timeout is None else timeout
        total = len(self._participants)
        deadline = time.monotonic() + timeout
        with _store_errors("waiting at the exit barrier", self._where):
            self._store.add(self._rk("done"), 1)
            while int(self._store.add(self._rk("done"), 0)) < total:
                if self.job_failure() or self.restart_request() or self.lost_nodes():
                    log.warning("exit barrier: another node failed, restarts or left; this node's workers succeeded")
                    break
                if time.monotonic() > deadline:
                    log.warning("exit barrier: not every node finished within %g s; leaving", timeout)
                    break
                time.sleep(_POLL * 2)
            self.set_closed()
            exited = self._store.add(self._rk("exited"), 1)
            if self.is_host:  # keep serving until the others are past their last read
                linger = time.monotonic() + 5.0
                while exited < total and time.monotonic() < linger:
                    time.sleep(_POLL)
                    exited = int(self._store.add(self._rk("exited"), 0))

    def is_closed(self) -> bool:
        return self._store.check([self._k("closed")])

    def set_closed(self) -> None:
        self._store.set(self._k("closed"), b"1")

    def shutdown(self) -> bool:
        """Stop the heartbeat, announce that this node left, release the store."""
        self._stop.set()
        clean = True
        if self._round is not None:
            try:
                self._store.set(self._rk("left", self._node_id), b"1")
            except DistError as exc:
                log.debug("could not announce leaving: %s", exc)
                clean = False
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=self._settings.read_timeout)
        self._store.close()
        return clean
