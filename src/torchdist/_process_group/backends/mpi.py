"""The "mpi" backend: the TCP backend's op layer over MPI, for jobs started by ``mpiexec``.

As the shared-memory backend does, it keeps everything of ``tcp.py`` (sequence
numbers, fingerprints, Work, the engine, group health, the algorithms) and
swaps the transport: ``_connect`` makes an MPI communicator of the group's
members and hands it to :class:`~torchdist._transport.mpi.MpiTransport`. So
mismatched collectives are caught and a stalled rank is named at the timeout,
which MPI libraries themselves leave to a hang.

Like PyTorch's ``ProcessGroupMPI``, ``init_process_group("mpi")`` takes the rank and
world size from MPI (:func:`rendezvous_over_mpi`); torchdist also gives the job a
store, so that groups of other backends, object collectives and everything else
that needs one work as usual.

mpi4py is imported only here and in the transport, on first use: importing it
initializes MPI.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import warnings
from datetime import timedelta

from ...errors import DistBackendError
from ..._store.tcp_store import TCPStore
from ..._transport.base import Transport
from ..._transport.mpi import MpiTransport
from .tcp import TcpBackend

__all__ = ["MpiBackend", "load_mpi", "mpi_installed", "rendezvous_over_mpi"]

_MISSING = ("Distributed package doesn't have MPI built in: the 'mpi' backend needs mpi4py and an MPI library "
            "(e.g. `pip install mpi4py mpich`, or the MPI your cluster provides), and a job started by mpiexec")


def mpi_installed() -> bool:
    """Whether mpi4py can be imported (checked without importing it: that starts MPI)."""
    return importlib.util.find_spec("mpi4py") is not None


def load_mpi():
    """mpi4py's ``MPI`` module (initializing MPI), or RuntimeError saying what to install."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise RuntimeError(f"{_MISSING}: {exc}") from exc
    return MPI


def rendezvous_over_mpi(rank: int, world_size: int, timeout: timedelta) -> tuple[TCPStore, int, int]:
    """``(store, rank, world_size)`` of a job started by mpiexec: rank and size are MPI's
    (given ones are ignored with a warning, as by PyTorch); the store is a TCPStore that
    rank 0 hosts on a free port, its address broadcast by MPI (MASTER_ADDR, if set, is
    the address the others use; by default 127.0.0.1 when every rank is on rank 0's
    host, else rank 0's host name)."""
    world = load_mpi().COMM_WORLD
    if rank != -1 or world_size != -1:
        warnings.warn(f"For MPI backend, world_size ({world_size}) and rank ({rank}) are ignored since they are "
                      "assigned by the MPI runtime.", stacklevel=3)
    rank, world_size = world.Get_rank(), world.Get_size()
    launched = os.environ.get("WORLD_SIZE")
    if launched is not None and launched != str(world_size):
        # e.g. torchdist-run started this process: each rank would be an MPI job of its own
        # and train alone, silently
        raise RuntimeError(
            f"init_process_group('mpi'): this process's environment says WORLD_SIZE={launched} (a launcher such "
            f"as torchdist-run started it), but its MPI job has {world_size} process(es). Backend 'mpi' takes "
            "rank and world size from MPI: start the job with `mpiexec -n N python ...`, or use backend 'gloo' "
            "under torchdist-run.")
    hosts = world.allgather(socket.gethostname())
    if rank == 0:
        address = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if len(set(hosts)) == 1 else hosts[0])
        store = TCPStore(address, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        world.bcast((address, store.port), root=0)
    else:
        address, port = world.bcast(None, root=0)
        store = TCPStore(address, port, world_size, is_master=False, timeout=timeout)
    return store, rank, world_size


class MpiBackend(TcpBackend):
    """One rank's end of a process group whose ranks talk through MPI."""

    name = "mpi"

    def _connect(self) -> Transport:
        MPI = load_mpi()
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise DistBackendError(
                f"{self._label}: backend 'mpi' needs an MPI initialized with MPI_THREAD_MULTIPLE (each group's "
                f"ops run on their own thread), but this one provides thread level {MPI.Query_thread()}. Leave "
                "mpi4py.rc.thread_level at its default ('multiple') and use an MPI library built with threads.")
        world = MPI.COMM_WORLD
        # Each member says which MPI process it is; reading them all through the store is
        # also the barrier (bounded by the timeout, naming a missing rank by its key)
        # that makes the MPI call below, which cannot time out, sure to complete.
        self.store.set(f"mpi/{self._rank}", f"{world.Get_rank()} {world.Get_size()}")
        members = [tuple(map(int, self.store.get(f"mpi/{peer}").split())) for peer in range(self._size)]
        mpi_ranks = [mpi_rank for mpi_rank, _size in members]
        if len({size for _rank, size in members}) > 1 or len(set(mpi_ranks)) < self._size:
            raise DistBackendError(
                f"{self._label}: backend 'mpi' needs every rank of the group in one MPI job, but its ranks "
                f"{self.global_ranks} are (MPI rank, MPI world size) {members}. Start every rank with one "
                "`mpiexec -n N python ...` and call init_process_group('mpi').")
        comm = world.Create_group(world.Get_group().Incl(mpi_ranks))
        return MpiTransport(comm, self.global_ranks, self._label)

    def quiesce(self) -> None:
        """At exit, also close the transport. A process has no sockets for the OS to close:
        peers waiting on it learn that it left only from its LEFT notices (else they
        would wait for their timeout, and it for them inside MPI_Finalize, which mpi4py
        calls after Python's exit handlers)."""
        super().quiesce()
        if os.getpid() == self._pid:
            self._close(DistBackendError(f"{self._label}: {self._me()}: the process is exiting"), notify=False)
