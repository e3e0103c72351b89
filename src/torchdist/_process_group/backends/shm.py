"""The "shm" backend: every rank of the group on one host, data through shared memory.

It is the TCP backend's op layer (sequence numbers, fingerprints, Work, the
engine, group health; see ``tcp.py``) over another transport and another
algorithm family:

- ``_connect`` maps the group's shared-memory board
  (:class:`~torchdist._transport.shm.ShmTransport`) instead of a socket mesh;
- collectives run ``torchdist._algorithms.shm_direct``, which reads peers'
  memory directly through the step protocol; point-to-point ops and all-to-all's
  payload travel as messages through the transport's rings.

Before mapping anything the ranks exchange their host identity through the
store (:func:`exchange_hosts`), so ranks on different hosts get a clear error
naming the hosts instead of a hang.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch.autograd import profiler as torch_profiler

from ...errors import DistBackendError
from ..._algorithms import shm_direct
from ..._algorithms.comm import Comm
from ..._algorithms.reduction import Average
from ..._transport.framing import OpFingerprint, OpKind
from ..._transport.base import Transport
from ..._transport.shm import ShmTransport
from ..._transport.shm_segment import host_identity, supported
from .. import profiling
from ..op_timeout import op_seconds
from ..reduce_op import ReduceOp, reduction_key
from ..work import Work
from .tcp import WAKE_BYTES, TcpBackend, memo

__all__ = ["ShmBackend", "exchange_hosts", "describe_hosts"]


def exchange_hosts(store, rank: int, size: int) -> list[str]:
    """Every rank's host identity (``shm_segment.host_identity``), in group-rank order."""
    store.set(f"host/{rank}", host_identity())
    return [store.get(f"host/{peer}").decode() for peer in range(size)]


def describe_hosts(hosts: list[str], names: list[int]) -> str:
    """E.g. ``ranks [0, 1] on host 'a/...' and ranks [2, 3] on host 'b/...'``."""
    groups: dict[str, list[int]] = {}
    for host, name in zip(hosts, names):
        groups.setdefault(host, []).append(name)
    return " and ".join(f"ranks {ranks} on host {host!r}" for host, ranks in groups.items())


class ShmBackend(TcpBackend):
    """One rank's end of a process group whose ranks share memory on one host."""

    name = "shm"
    _algorithms = shm_direct

    def __init__(self, *args, **kwargs) -> None:
        self._plans: dict[tuple, tuple | None] = {}  # all-reduce plans by (op, dtype, numel)
        super().__init__(*args, **kwargs)

    def _connect(self) -> Transport:
        why = supported()
        if why is not None:
            raise DistBackendError(f"{self._label}: backend 'shm' is not available: {why}. "
                                   "Use backend='tcp' (or 'auto', which picks it).")
        if self._size > 1:
            hosts = exchange_hosts(self.store, self._rank, self._size)
            if len(set(hosts)) > 1:
                raise DistBackendError(
                    f"{self._label}: backend 'shm' needs every rank on one host, but this group has "
                    f"{describe_hosts(hosts, self.global_ranks)}. Use backend='auto' (shared memory within "
                    "a host, TCP between hosts) or 'tcp'.")
        return ShmTransport.connect(self.store, self._rank, self._size, self._seconds, self.global_ranks,
                                    self._label)

    def allocate_symmetric(self, nbytes: int) -> torch.Tensor:
        """Collective: ``nbytes`` of symmetric memory (``_transport/shm_heap``), as uint8."""
        if self._broken is not None:
            raise DistBackendError(f"{self._label}: {self._me()} cannot allocate symmetric memory: the group is "
                                   f"broken by an earlier error ({self._broken})") from self._broken
        return self._transport.heap.allocate(nbytes)

    # -- running collectives on the caller's thread -------------------------------------
    # On shared memory a collective is pure CPU work on the caller's core. Handing it
    # to the engine's worker costs two thread wake-ups (30-300 us each on the 2-core
    # VM: a 256 KiB all-reduce took 226 us that way, 40 us inline) and buys overlap
    # with compute that competes for the same cores. So when the engine is idle (no
    # queued op, no thread driving the transport) a collective runs right here, holding the
    # engine (``Engine.take``) so nothing else drives the transport, and returns an
    # already completed (or failed) Work. Ops still run in issue order: the engine
    # runs queued ops in that order anyway, so this adds no wait that the engine
    # would not have.
    #
    # An ``async_op=True`` collective runs here only if every peer is already inside
    # it (``Steps.peers_inside``): then it finishes without anything the caller does
    # next. Otherwise it goes to the worker, because a peer may need what the caller
    # does next (a send, a collective on another group) before it joins this one.
    # Where every rank has a spare core (``async_overlaps_compute``), a large one
    # goes to the worker anyway: there it runs beside the caller's compute, which is
    # what the caller asked for (DDP's buckets, on such hosts).

    @property
    def async_overlaps_compute(self) -> bool:
        return self._transport.board.spare_cores

    def _runs_inline(self, outputs: list[torch.Tensor]) -> bool:
        """Whether an ``async_op=True`` op on ``outputs`` runs on the caller's thread (see above)."""
        if self._transport.board.spare_cores and sum(t.nbytes for t in outputs) >= WAKE_BYTES:
            return False
        return self._transport.steps.peers_inside()

    def _collective(self, op_name: str, outputs: list[torch.Tensor], fingerprint: OpFingerprint,
                    run: Callable[[Comm], None], async_op: bool, seconds: float | None = None) -> Work:
        if self._broken is None and (not async_op or self._runs_inline(outputs)):
            work = self._inline(op_name, outputs, fingerprint, run, seconds=seconds)
            if work is not None:
                return work
        return super()._collective(op_name, outputs, fingerprint, run, async_op, seconds)

    def allreduce(self, tensors: list[torch.Tensor], op: ReduceOp = ReduceOp.SUM, *,
                  async_op: bool = False) -> Work:
        """A single-tensor all-reduce (not PREMUL_SUM) runs from a cached plan: its
        reduce-op translation and fingerprint cost more than a small op's data."""
        if len(tensors) == 1 and self._broken is None and (not async_op or self._runs_inline(tensors)):
            tensor = tensors[0]
            plan = memo(self._plans, (reduction_key(op), tensor.dtype, tensor.numel()), self._plan, op, tensor.dtype,
                        tensor.numel())
            if plan is not None:
                fingerprint, combine, finish = plan
                flat = tensor if tensor.dim() == 1 else tensor.view(-1)  # view() costs ~1 us
                work = self._inline("allreduce", tensors, fingerprint, shm_direct.allreduce, flat, combine, finish)
                if work is not None:
                    return work
        return super().allreduce(tensors, op, async_op=async_op)

    def _plan(self, op: ReduceOp, dtype: torch.dtype, numel: int) -> tuple | None:
        """(fingerprint, combiner, finisher) of a single-tensor all-reduce; None for PREMUL_SUM."""
        code, combine, premul, is_avg = self._reduction(op, dtype)
        if premul is not None:
            return None
        return (OpFingerprint.of(OpKind.ALLREDUCE, dtype, numel, -1, code), combine,
                Average(self._size) if is_avg else None)

    def _inline(self, op_name: str, outputs: list[torch.Tensor], fingerprint: OpFingerprint,
                run: Callable[..., None], *args, seconds: float | None = None) -> Work | None:
        """``run(comm, *args)`` now on this thread if the engine is idle; None if it is not.
        ``seconds``: the op's timeout, if not the group's."""
        seconds = op_seconds(seconds)
        limit = self._seconds if seconds is None else seconds
        error = None
        with self._issue:  # the sequence number and the engine are taken together
            if not self._engine.take():
                return None  # queued ops, or another thread drives: take the ordinary path
            seq = self.seq
            self.seq = seq + 1
            try:
                comm = Comm(self._transport, seq, fingerprint, time.monotonic() + limit, self._scratch)
                if torch_profiler._is_profiler_enabled:  # (read here: this is the small ops' hot path)
                    span = profiling.open_span(self.name, op_name)
                    try:
                        run(comm, *args)
                    finally:
                        span.close()
                else:
                    run(comm, *args)
            except BaseException as exc:  # noqa: BLE001 - becomes the Work's error below
                error = exc
            finally:
                self._engine.release()
        if error is None:
            return Work.completed(op_name, outputs)
        work = Work(op_name, outputs)
        work._fail(self._failure(error, op_name, seq, seconds))
        return work
