"""Dynamic membership (``init_rpc(..., world_size=None)``): workers join and leave a running group.

As in PyTorch's TensorPipe agent, each worker brings its own rank; workers may
start after others are running and leave (``shutdown``) while others go on. They
meet through the store of ``init_method`` (rank 0 hosts a TCPStore for ``env://``
and ``tcp://``, so it starts first and leaves last, as in PyTorch). Keys, under
``rpc/dynamic/``::

    token            join/leave critical section: compare_set("" -> my token);
                     released/<token> is set when it is given back (waiters wait on it)
    ids/<rank>       the name of the worker holding that rank: compare_set refuses duplicates
    members          JSON [[name, rank, "host:port"], ...]: the group now

Join (init_rpc), with the token held::

    ids/<rank> := name (else "RPC worker id ... is not unique")
    read members; a member with my name ─► "RPC worker name ... is not unique"
    listen; for each member: dial, HELLO(magic, rank), authenticate (handshake.py),
        same-host upgrade; the member adds me to its agent, then sends ACK
    start the agent; members += me; give the token back

Leave (shutdown), graceful::

    wait for this worker's calls and RRef deletions (as in a static world)
    with the token: members -= me, delete ids/<rank>, tell every member over RPC
        (``member_left``: it drops me from its agent) ─► close (GOODBYE, EOF)

There is no barrier: the others keep running. A non-graceful shutdown only
removes its store entries (best effort); the others learn from the closed
connections. PyTorch differs in two places: a join that fails keeps PyTorch's
token forever (every later join or leave hangs), here it is given back; and each
``init_rpc`` of a process uses a fresh store prefix in PyTorch, so a worker that
rejoins sees nobody, while here it rejoins the group.

A static world (``world_size`` given) is the case where the membership is known
up front: the same agent, built with every peer at once (``api.init_rpc``).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import struct
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable, Iterator
from urllib.parse import parse_qs, urlparse

from .._store import FileStore, PrefixStore, TCPStore
from .._transport.mesh import local_address
from ..errors import DistError, DistNetworkError, DistStoreError
from . import same_host
from .handshake import authenticate, recv_exact
from .options import WorkerInfo

__all__ = ["STATIC_GROUP_KEY", "check_group_kind", "dynamic_store", "Membership", "Listener"]

logger = logging.getLogger(__name__)

STATIC_GROUP_KEY = "rpc/is_static_group"
_HELLO = struct.Struct("<8sq")
_MAGIC = b"TDRPCJN1"
_ACK = b"\x01"
_JOINING = "while joining the RPC group"  # what recv_exact says was going on


def check_group_kind(store, static: bool) -> None:
    """Refuse to mix statically and dynamically initialized workers in one job (PyTorch's check)."""
    mine = "true" if static else "false"
    theirs = store.compare_set(STATIC_GROUP_KEY, "", mine).decode()
    if theirs != mine:
        raise RuntimeError(f"RPC group mixes statically and dynamically initialized members which is not "
                           f"supported. Static group property is initialized as {theirs} and is trying to be set "
                           f"as {mine}. Pass world_size to every init_rpc of the job, or to none.")


def dynamic_store(init_method: str, rank: int, timeout: timedelta) -> tuple[object, int]:
    """The job's store and this worker's rank, for a group without a world size."""
    parsed = urlparse(init_method)
    query = parse_qs(parsed.query)
    if rank == -1 and "rank" in query:
        rank = int(query["rank"][0])
    if rank == -1 and parsed.scheme == "env" and "RANK" in os.environ:
        rank = int(os.environ["RANK"])
    if not isinstance(rank, int) or rank < 0:
        raise ValueError(f"init_rpc with world_size=None needs this worker's rank (>= 0), got {rank!r}: pass "
                         "rank=... (or set RANK for env://)")
    if parsed.scheme == "file":
        store = FileStore(parsed.path or parsed.netloc)
        store.set_timeout(timeout)
        return store, rank
    if parsed.scheme == "env":
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if host is None or port is None:
            raise ValueError("Error initializing torchdist using env:// rendezvous: environment variables "
                             "MASTER_ADDR and MASTER_PORT expected, but not set.")
    elif parsed.scheme == "tcp":
        host, port = parsed.hostname, parsed.port
        if not port:
            raise ValueError(f"Error initializing torchdist using {init_method}: port number missing")
    else:
        raise RuntimeError(f"No rendezvous handler for {parsed.scheme}://")
    # As in PyTorch, for env:// the process's RANK (not the rank argument) says who hosts the store.
    host_rank = int(os.environ.get("RANK", rank)) if parsed.scheme == "env" else rank
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = TCPStore(host, int(port), None, is_master=(host_rank == 0 and not agent_hosts_store), timeout=timeout,
                     multi_tenant=True)
    return store, rank


class Membership:
    """The group's entries in the store (see the module docstring); ``store`` is the job's store."""

    def __init__(self, store, me: WorkerInfo, timeout: float) -> None:
        self.store = PrefixStore("rpc/dynamic", store)
        self.me = me
        self.timeout = timeout

    @contextmanager
    def token(self, action: str) -> Iterator[None]:
        """Hold the group's join/leave token (one join or leave at a time in the whole group)."""
        mine = f"{self.me.name}/{action}/{secrets.token_hex(8)}"
        deadline = time.monotonic() + self.timeout
        while True:
            held = self.store.compare_set("token", "", mine).decode()
            if held == mine:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DistStoreError(f"{self.me}: timed out after {self.timeout:.0f}s waiting for the RPC group's "
                                     f"membership token, held by {held!r} (a join or leave in progress)")
            try:
                self.store.wait([f"released/{held}"], timedelta(seconds=remaining))
            except DistError:
                continue  # timed out: the loop reports it with the holder's name
        try:
            yield
        finally:
            self.store.set("token", "")
            self.store.set(f"released/{mine}", "1")

    def members(self) -> list[tuple[WorkerInfo, str]]:
        """The group now: each member and the address it listens on."""
        if not self.store.check(["members"]):
            return []
        return [(WorkerInfo(name, rank), address) for name, rank, address in
                json.loads(self.store.get("members").decode())]

    def claim(self) -> list[tuple[WorkerInfo, str]]:
        """(token held) Take this worker's rank and check its name; the members it must connect to."""
        name, rank = self.me.name, self.me.id
        holder = self.store.compare_set(f"ids/{rank}", "", name).decode()
        if holder != name:
            raise RuntimeError(f"RPC worker id {rank} is not unique. Worker {holder} already has ID {rank} and "
                               f"{name} cannot be added.")
        members = [(info, address) for info, address in self.members() if info.id != rank]
        for info, _ in members:
            if info.name == name:
                self.store.delete_key(f"ids/{rank}")
                raise RuntimeError(f"RPC worker name {name} is not unique. Workers {rank} and {info.id} share the "
                                   "same name.")
        return members

    def publish(self, address: str) -> None:
        """(token held) Add this worker to ``members``: later joiners connect to it."""
        entries = [[w.name, w.id, a] for w, a in self.members() if w.id != self.me.id]
        entries.append([self.me.name, self.me.id, address])
        self.store.set("members", json.dumps(entries))

    def withdraw(self) -> None:
        """(token held) Remove this worker from ``members`` and free its rank."""
        entries = [[w.name, w.id, a] for w, a in self.members() if w.id != self.me.id]
        self.store.set("members", json.dumps(entries))
        self.store.delete_key(f"ids/{self.me.id}")

    def connect(self, members: list[tuple[WorkerInfo, str]], secret: bytes | None,
                shm: bool) -> dict[int, socket.socket]:
        """(token held) One authenticated connection to each member, in the order the agent needs."""
        sockets: dict[int, socket.socket] = {}
        try:
            for info, address in members:
                sockets[info.id] = self._dial(info, address, secret, shm)
        except BaseException:
            for sock in sockets.values():
                sock.close()
            raise
        return sockets

    def _dial(self, info: WorkerInfo, address: str, secret: bytes | None, shm: bool) -> socket.socket:
        host, _, port = address.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(_HELLO.pack(_MAGIC, self.me.id))
        except OSError as exc:
            raise DistNetworkError(f"{self.me} could not connect to RPC group member {info} at {address}: {exc}. "
                                   "It may have died without leaving the group.") from exc
        try:
            authenticate(sock, True, repr(info), secret, self.timeout)
            sock = same_host.upgrade(sock, True, repr(info), shm, self.timeout)
            sock.settimeout(self.timeout)
            if recv_exact(sock, 1, _JOINING) != _ACK:
                raise DistNetworkError(f"{info} refused {self.me} as a new RPC group member")
            sock.settimeout(None)
        except OSError as exc:
            sock.close()
            raise DistNetworkError(f"{self.me}: joining RPC group member {info} failed: {exc}") from exc
        except BaseException:
            sock.close()
            raise
        return sock


class Listener:
    """Accepts the workers that join after this one; ``on_join(info, sock, ack)`` adds each to the agent.

    One thread; joins are serialized by the group's token anyway. A joiner that
    fails the handshake is logged and dropped; the listener goes on.
    """

    def __init__(self, membership: Membership, secret: bytes | None, shm: bool,
                 on_join: Callable[[WorkerInfo, socket.socket, bytes], None]) -> None:
        self._membership = membership
        self._secret = secret
        self._shm = shm
        self._on_join = on_join
        host = local_address()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.bind((host, 0))
            self._sock.listen(16)
        except OSError as exc:
            self._sock.close()
            raise DistNetworkError(f"RPC agent {membership.me} cannot listen on {host}: {exc}") from exc
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._closed = False
        self._joiner: WorkerInfo | None = None  # the worker being admitted (listener thread only)
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"rpc-listener-{membership.me.name}")

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept()
        except OSError:
            pass
        self._sock.close()
        self._thread.join(5.0)

    def _accept_loop(self) -> None:
        me = self._membership.me
        while not self._closed:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return  # closed
            admitted = None
            try:
                admitted = self._admit(sock)
                admitted.settimeout(None)
                self._on_join(self._joiner, admitted, _ACK)
                logger.info("rpc: %s joined %s's group", self._joiner, me)
            except (OSError, RuntimeError, ValueError) as exc:  # DistError is a RuntimeError
                sock.close()
                if admitted is not None:
                    admitted.close()
                if not self._closed:
                    logger.warning("%s: a worker joining the RPC group failed: %s", me, exc)

    def _admit(self, sock: socket.socket) -> socket.socket:
        """HELLO, authentication and same-host upgrade of a joiner; its socket (maybe a new one)."""
        timeout = self._membership.timeout
        sock.settimeout(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        magic, rank = _HELLO.unpack(recv_exact(sock, _HELLO.size, _JOINING))
        if magic != _MAGIC:
            raise DistNetworkError(f"not a torchdist RPC worker (magic={magic!r})")
        name = self._membership.store.get(f"ids/{rank}").decode()
        self._joiner = WorkerInfo(name, rank)
        authenticate(sock, False, repr(self._joiner), self._secret, timeout)
        return same_host.upgrade(sock, False, repr(self._joiner), self._shm, timeout)
