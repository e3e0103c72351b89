"""The "auto" backend (the default; "gloo" is an alias): shared memory within a host, TCP across.

At creation the ranks of the group exchange their host identity through the
store, then:

=============================================  ==========================================
ranks                                          backend
=============================================  ==========================================
all on one host (shared memory usable)         :class:`~.shm.ShmBackend`
each on its own host, or shm unsupported here  :class:`~.tcp.TcpBackend`
several hosts, some with several ranks         :class:`HierarchicalBackend`
=============================================  ==========================================

:class:`HierarchicalBackend` holds three groups: ``flat`` (TCP between all ranks),
``local`` (shared memory between the ranks of this host) and, on each host's
first rank (its *leader*), ``leaders`` (TCP between the leaders). All-reduce is
hierarchical: reduce within the host into the leader, all-reduce between the
leaders, broadcast within the host, so only one rank per host puts bytes on the
network. It runs as one op of the flat group (so it keeps its place in the
group's order, async or not) whose body drives the two sub-groups. Every other
op, point-to-point included, runs on the flat group. While the body waits in a
sub-group, the flat group's point-to-point transfers keep moving (the
sub-groups' transports call ``_move_flat`` at every round of a wait:
``Transport.companion``): a peer may need a send posted before or during the
all-reduce before it joins it.

Errors reach every rank, as on the other backends:

- *mismatches*: the sub-groups' fingerprints only cover what they see, so a
  hierarchical all-reduce first sends its fingerprint to every flat peer (a
  header, no payload, received at the end of the op). A rank that is in another
  op at that sequence number gets it where it expects its own op's data, and
  raises naming both ops;
- *breaks*: the flat group breaking (its own error, or a sub-group's error
  surfacing through the all-reduce's body) breaks the two sub-groups too, which
  ABORTs their peers: a rank waiting in its host's broadcast, or a leader in
  the leaders' all-reduce, hears of a failure anywhere within moments.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch

from ...errors import DistBackendError
from ..._algorithms.comm import Comm, flatten, unflatten_into
from ..._algorithms.reduction import average
from ..._store.prefix_store import PrefixStore
from ..._transport.framing import OpFingerprint
from ..._transport.shm_segment import supported
from ..backend import ProcessGroupBackend
from ..reduce_op import ReduceOp
from ..work import Work
from .shm import ShmBackend, exchange_hosts
from .tcp import TcpBackend, allreduce_fingerprint

__all__ = ["AutoBackend", "HierarchicalBackend"]


class AutoBackend(ProcessGroupBackend):
    """Creating one returns the backend that fits the group's hosts (see the module docstring)."""

    name = "auto"

    def __new__(cls, store, rank: int, size: int, timeout: timedelta, group_name: str = "",
                global_ranks: list[int] | None = None):
        names = list(global_ranks) if global_ranks is not None else list(range(size))
        if supported() is not None:
            return TcpBackend(PrefixStore("tcp/", store), rank, size, timeout, group_name, names)
        if size == 1:
            return ShmBackend(PrefixStore("shm/", store), rank, size, timeout, group_name, names)
        hosts = exchange_hosts(PrefixStore("auto/", store), rank, size)
        distinct = list(dict.fromkeys(hosts))
        if len(distinct) == 1:
            return ShmBackend(PrefixStore("shm/", store), rank, size, timeout, group_name, names)
        if len(distinct) == size:
            return TcpBackend(PrefixStore("tcp/", store), rank, size, timeout, group_name, names)
        return HierarchicalBackend(store, rank, size, timeout, group_name, names, hosts)


class HierarchicalBackend(ProcessGroupBackend):
    """Shared memory within each host, TCP between hosts; hierarchical all-reduce."""

    name = "auto"

    def __init__(self, store, rank: int, size: int, timeout: timedelta, group_name: str,
                 global_ranks: list[int], hosts: list[str]) -> None:
        super().__init__(store, rank, size, timeout, group_name, global_ranks)
        distinct = list(dict.fromkeys(hosts))
        host = distinct.index(hosts[rank])
        members = [i for i in range(size) if hosts[i] == hosts[rank]]
        leaders = [hosts.index(h) for h in distinct]
        self.flat = TcpBackend(PrefixStore("flat/", store), rank, size, timeout, group_name, global_ranks)
        self.local = ShmBackend(PrefixStore(f"host{host}/", store), members.index(rank), len(members), timeout,
                                f"{group_name}:host{host}", [global_ranks[i] for i in members])
        self.leaders = None
        if rank in leaders:
            self.leaders = TcpBackend(PrefixStore("leaders/", store), host, len(distinct), timeout,
                                      f"{group_name}:leaders", [global_ranks[i] for i in leaders])
        self.flat.on_break = self._break_subgroups
        for backend in (self.local, self.leaders):
            if backend is not None:
                backend._transport.companion = self._move_flat

    @ProcessGroupBackend.timeout.setter
    def timeout(self, value: timedelta) -> None:
        ProcessGroupBackend.timeout.fset(self, value)
        if "flat" in self.__dict__:  # set_timeout, not the base class's __init__
            for backend in self._parts():
                backend.timeout = value

    def _move_flat(self) -> None:
        """Called while an all-reduce waits in a sub-group: the flat group's P2P transfers,
        and the ops other threads posted to it meanwhile, keep moving. A peer may need them
        before it joins the all-reduce (gloo moves them on threads of their own)."""
        transport = self.flat._transport
        if transport.on_poll is not None or transport.pending():
            transport.progress(0)

    def _break_subgroups(self, error: BaseException) -> None:
        """The flat group broke: so do the others (run on the flat group's driving thread,
        the only one that drives the sub-groups: they only run inside its ops)."""
        for backend in (self.local, self.leaders):
            if backend is not None:
                backend._break(error)

    @property
    def seq(self) -> int:
        return self.flat.seq if "flat" in self.__dict__ else 0

    @seq.setter
    def seq(self, value: int) -> None:  # the base class initializes it; the flat group counts
        pass

    def allreduce(self, tensors: list[torch.Tensor], op: ReduceOp = ReduceOp.SUM, *,
                  async_op: bool = False) -> Work:
        # What the op means for this dtype, worked out (and refused, e.g. SUM of float8)
        # before anything is sent, as on the flat group's own ops.
        code, _, premul, is_avg = self.flat._reduction(op, tensors[0].dtype)
        sub_op = ReduceOp.SUM if is_avg or premul is not None else op
        nbytes = sum(t.nbytes for t in tensors)
        fingerprint = allreduce_fingerprint(tensors, code)

        def body(work, seq: int) -> None:
            announced = self._announce(seq, fingerprint)
            flat = flatten(tensors)
            if premul is not None:
                flat.mul_(premul)
            self.local.reduce(flat, 0, sub_op).wait()       # reduce within the host, into its leader
            if self.leaders is not None:
                self.leaders.allreduce([flat], sub_op).wait()  # all-reduce between the leaders
            self.local.broadcast(flat, 0).wait()             # broadcast within the host
            if is_avg:
                average(flat, self._size)
            unflatten_into(flat, tensors)
            announced()
        return self.flat._issue_op("allreduce", tensors, True, body, nbytes, async_op)

    def _announce(self, seq: int, fingerprint: OpFingerprint):
        """Send this op's fingerprint to every flat peer and post the receives of theirs;
        returns the wait for all of them (see the module docstring)."""
        comm = Comm(self.flat._transport, seq, fingerprint, time.monotonic() + self.flat._seconds, None)
        empty = torch.empty(0, dtype=torch.uint8)
        peers = [peer for peer in range(self._size) if peer != self._rank]
        transfers = [comm.recv(peer, empty) for peer in peers] + [comm.send(peer, empty) for peer in peers]
        return lambda: comm.wait(*transfers)

    def _parts(self) -> list[ProcessGroupBackend]:
        """The flat group first: its ops (hierarchical ones included) use the others."""
        return [backend for backend in (self.flat, self.local, self.leaders) if backend is not None]

    def shutdown(self) -> None:
        for backend in self._parts():
            backend.shutdown()

    def abort(self) -> None:
        for backend in self._parts():
            backend.abort()

    def fail(self, op_name: str, error: DistBackendError) -> None:
        self.flat.fail(op_name, error)  # which breaks the sub-groups (on_break)

    def quiesce(self) -> None:
        for backend in self._parts():
            backend.quiesce()


def _on_flat(op: str):
    def delegate(self, *args, **kwargs) -> Work:
        return getattr(self.flat, op)(*args, **kwargs)
    delegate.__name__ = op
    delegate.__doc__ = f"``{op}`` on the flat TCP group."
    return delegate


for _op in ("broadcast", "reduce", "allgather", "allgather_into_tensor", "gather", "scatter",
            "reduce_scatter", "reduce_scatter_tensor", "alltoall", "barrier", "send", "recv"):
    setattr(HierarchicalBackend, _op, _on_flat(_op))
