"""The "tcp" backend: every collective and point-to-point op over a TCP mesh.

Data flow of one call: the API layer hands over contiguous tensors and group
ranks -> this backend numbers the op (the group's *sequence number*, collectives
only), builds its *fingerprint* (kind, dtype, element count, root, reduce op),
translates the reduce op into a combiner plus scaling, and queues the op on the
:class:`~torchdist._transport.engine.Engine` -> an algorithm from
``torchdist._algorithms`` runs over the transport.

Group health::

    healthy ──first fatal error (dead peer, mismatch, timeout, ABORT received)──▶ broken

On the first error the rank that detected it breaks its transport, which sends
an ABORT carrying the message to every peer, so every rank raises, naming the op,
the sequence number and the ranks involved. A broken group fails queued ops and
raises at once on every later call, with the original error as the cause.

An ``async_op=True`` collective wakes the engine's worker, so it progresses
while the caller does anything else (a peer may need it before it can join what
the caller does next); so does a synchronous one of ``WAKE_BYTES`` or more (the
worker starts it while the caller's thread gets to ``wait``); a smaller
synchronous one runs on the caller's thread when it waits.

Point-to-point ops are *posted* when issued, not queued behind the collectives
issued before them (``Engine.post``): a peer may need the send before it joins
those. They carry the current sequence number but do not advance it. Timeouts: a
collective fails ``timeout`` after it starts; a P2P op ``timeout`` after it was
posted (the worker enforces it while nobody waits).

This module is the one backend over ``Transport``; a backend for another
transport (shared memory) subclasses it and overrides ``_connect``.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from datetime import timedelta
from typing import Callable

import torch

from ...errors import DistBackendError, DistError
from ..._algorithms import collectives as algo
from ..._algorithms.comm import Comm, Scratch, byte_view, flatten, unflatten_into
from ..._algorithms.reduction import Average, average, combiner
from ..._transport.base import PeerTimeout, Transfer, Transport
from ..._transport.engine import Engine, EngineOp
from ..._transport.framing import MsgKind, OpFingerprint, OpKind
from ..._transport.mesh import connect_mesh
from ..._transport.tcp import TcpTransport
from .. import profiling
from ..op_timeout import op_seconds
from ..backend import ProcessGroupBackend
from ..reduce_op import ReduceOp, RedOpType, as_red_op, reduction_key
from ..work import Work

__all__ = ["TcpBackend", "memo", "allreduce_fingerprint"]

#: Ops moving at least this many bytes per rank wake the worker at once. Below it a
#: thread wake-up and the GIL hand-off it causes (measured: 0.1-1.5 ms on the loaded
#: 2-core VM) cost more than the op itself.
WAKE_BYTES = 256 << 10
#: A caller driving its own P2P transfer looks this often (s) whether other ops were
#: queued meanwhile, which it then leaves to the worker (see ``TcpBackend._help``).
_DRIVE_SLICE_S = 0.02
#: ``shutdown`` waits for the ops in flight up to the group's timeout plus this (s).
_SETTLE_SLACK_S = 1.0
#: How often (s) the driving thread forgets finished P2P works and checks the others' deadlines.
_SWEEP_S = 0.01
#: How long closing waits for a thread told to leave the transport (s).
_LEAVE_S = 5.0

logger = logging.getLogger(__name__)


class _OpWork(Work):
    """A Work whose ``wait()`` runs its op on the caller's thread when it can."""

    def __init__(self, backend: "TcpBackend", op_name: str, outputs: list[torch.Tensor]) -> None:
        super().__init__(op_name, outputs)
        self._backend = backend
        self._engine_op: EngineOp | None = None
        self._transfer: Transfer | None = None  # P2P: the posted transfer
        self._deadline: float | None = None

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        if self._done.is_set() or self._settling == threading.get_ident():
            return super().wait()
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        until = time.monotonic() + seconds if seconds else None
        self._backend._help(self, until)
        return self._wait_until(seconds, until)

    def is_completed(self) -> bool:
        if not self._done.is_set():
            self._backend._engine.kick()  # someone polls: make sure the op runs
        return super().is_completed()

    def get_future(self):
        if not self._done.is_set():
            self._backend._engine.kick()  # futures complete without wait(): run the op
        return super().get_future()


def memo(cache: dict, key, make: Callable, *args):
    """``cache[key]``, made by ``make(*args)`` on first use (None included). The cache is
    emptied past 256 keys: PREMUL_SUM factors could make keys without end."""
    try:
        return cache[key]
    except KeyError:
        pass
    if len(cache) > 256:
        cache.clear()
    value = cache[key] = make(*args)
    return value


def allreduce_fingerprint(tensors: list[torch.Tensor], code: int) -> OpFingerprint:
    """The fingerprint of an all-reduce of ``tensors`` (several: coalesced into one op)."""
    kind = OpKind.ALLREDUCE if len(tensors) == 1 else OpKind.ALLREDUCE_COALESCED
    return OpFingerprint.of(kind, tensors[0].dtype, sum(t.numel() for t in tensors), -1, code)


class TcpBackend(ProcessGroupBackend):
    """One rank's end of a process group whose ranks talk over TCP."""

    name = "tcp"
    #: The collective algorithms, as a module with ``_algorithms.collectives``' entry
    #: points; the shared-memory backend swaps in ``_algorithms.shm_direct``.
    _algorithms = algo

    def __init__(self, store, rank: int, size: int, timeout: timedelta, group_name: str = "",
                 global_ranks: list[int] | None = None, *, transport: Transport | None = None) -> None:
        super().__init__(store, rank, size, timeout, group_name, global_ranks)
        self._label = f"process group {group_name!r}" if group_name else "process group"
        self._pid = os.getpid()  # (see quiesce)
        self._transport = transport if transport is not None else self._connect()
        self._engine = Engine(self._transport, self._label, idle_step=self._idle_step)
        self._issue = threading.Lock()  # makes (seq, queue position) one step
        self._broken: BaseException | None = None
        self._p2p: list[_OpWork] = []  # posted P2P works not yet done (driver thread only)
        self._p2p_due = math.inf  # the earliest deadline among them
        self._p2p_swept = 0.0  # when _sweep_p2p last ran
        self._scratch = Scratch()  # reused by successive ops (one runs at a time)
        self._reductions: dict[tuple, tuple] = {}  # _reduction's answers by (op, dtype)
        #: Called once, on the driving thread, when the group breaks (a composite backend
        #: breaks its other groups too, see ``auto.HierarchicalBackend``).
        self.on_break: Callable[[BaseException], None] | None = None

    def _connect(self) -> Transport:
        sockets = connect_mesh(self.store, self._rank, self._size, self._seconds, self.global_ranks, self._label)
        return TcpTransport(self._rank, self._size, sockets, self.global_ranks, self._label)

    def _me(self) -> str:
        return f"rank {self.global_ranks[self._rank]}"

    # -- issuing ops -------------------------------------------------------------------
    def _issue_op(self, op_name: str, outputs: list[torch.Tensor], collective: bool,
                  body: Callable[[_OpWork, int], None], nbytes: int = 0, async_op: bool = False,
                  seconds: float | None = None) -> Work:
        """Queue (collective) or post (P2P) ``body``. ``nbytes``: a collective's size, which decides
        whether it starts on the worker at once; ``seconds``: its timeout, if not the group's."""
        if self._broken is not None:
            raise DistBackendError(
                f"{self._label}: {self._me()} cannot run {op_name}: the group is broken by an earlier "
                f"error ({self._broken}). Destroy it and create a new one.") from self._broken
        work = _OpWork(self, op_name, outputs)
        span = profiling.open_span(self.name, op_name)

        def execute() -> None:
            try:
                body(work, seq)
            except BaseException as exc:  # noqa: BLE001 - every failure fails the Work
                work._fail(self._failure(exc, op_name, seq if collective else None, seconds))
            else:
                if work._transfer is None:
                    work._complete()
            finally:
                if span is not None:
                    span.close()

        with self._issue:
            seq = self.seq
            if not collective:
                self._engine.post(EngineOp(execute, work._fail), caller_waits=not async_op)
                return work
            self.seq += 1
            work._engine_op = EngineOp(execute, work._fail)
            # Async and large ops start on the worker at once: async ones must progress
            # without the caller, large ones overlap with its compute. Small synchronous
            # ones run on the caller's thread when it waits (see Engine.submit).
            self._engine.submit(work._engine_op, wake=async_op or nbytes >= WAKE_BYTES)
        return work

    def _collective(self, op_name: str, outputs: list[torch.Tensor], fingerprint: OpFingerprint,
                    run: Callable[[Comm], None], async_op: bool, seconds: float | None = None) -> Work:
        seconds = op_seconds(seconds)
        limit = self._seconds if seconds is None else seconds

        def body(work: _OpWork, seq: int) -> None:
            run(Comm(self._transport, seq, fingerprint, time.monotonic() + limit, self._scratch))
        nbytes = sum(t.nbytes for t in outputs)
        return self._issue_op(op_name, outputs, True, body, nbytes, async_op, seconds)

    def _help(self, work: _OpWork, until: float | None) -> None:
        """Called by ``Work.wait`` on the caller's thread: run or drive the op if we can.

        A collective run here runs to its end (stopping one midway would break the
        group), so one waited on with a limit ``until`` goes to the worker instead,
        and the wait gives up at ``until``. A P2P transfer is driven until it is done,
        ``until`` passes, or another op is queued: a thread waiting for a message must
        not keep the transport from the collectives other threads issue meanwhile (the
        message may come only after one of them). Then the worker drives it."""
        op = work._engine_op
        if op is not None and not op.started and until is None:
            self._engine.run_now(op)
        if work._done.is_set():
            return
        if work._transfer is None or not self._engine.drive(
                lambda: work._done.is_set() or (until is not None and time.monotonic() >= until)
                or self._engine.queued(),
                lambda: self._drive_p2p(work, min(until or math.inf, time.monotonic() + _DRIVE_SLICE_S))):
            self._engine.kick()  # another thread drives, or ops are queued: the worker finishes it

    # -- failures ----------------------------------------------------------------------
    def _failure(self, exc: BaseException, op_name: str, seq: int | None,
                 seconds: float | None = None) -> BaseException:
        """Turn ``exc`` (raised on the driving thread) into the op's error; break the group.
        ``seconds``: the op's timeout, if not the group's.

        A ``KeyboardInterrupt`` stays the op's error, so that the program sees Ctrl-C as
        Ctrl-C; the group breaks all the same (the op stopped midway) and the peers
        learn that this rank was interrupted."""
        where = f"{op_name} (collective #{seq})" if seq is not None else op_name
        if isinstance(exc, PeerTimeout):
            names = [self.global_ranks[p] for p in exc.peers if p not in exc.joined]
            joined = [self.global_ranks[p] for p in exc.joined]
            if names:
                what = (f"ranks {names} did not arrive (they have not sent what this rank waits for; if they "
                        "did arrive, they wait on a rank that did not, and their own errors name it)")
                if joined:
                    what += f"; ranks {joined} joined it and are probably waiting on them"
            else:
                what = (f"ranks {joined} joined it but did not finish; they are waiting on other ranks "
                        "(see their errors)")
            error = DistBackendError(
                f"{self._label}: {where} timed out after {self._seconds if seconds is None else seconds:.1f}s on "
                f"{self._me()}: {what}. Check that every rank calls the same collectives in the same order, or "
                f"raise the {'group' if seconds is None else 'op'}'s timeout.")
        elif isinstance(exc, DistError):
            detail = str(exc).removeprefix(f"{self._label}: ")  # the transport's errors name the group too
            error = DistBackendError(f"{self._label}: {where} failed on {self._me()}: {detail}")
        elif isinstance(exc, KeyboardInterrupt):
            error = DistBackendError(f"{self._label}: {where} was interrupted on {self._me()} (KeyboardInterrupt)")
        else:
            error = DistBackendError(f"{self._label}: {where} failed on {self._me()}: "
                                     f"{type(exc).__name__}: {exc}")
        error.__cause__ = exc
        self._break(error)
        return exc if isinstance(exc, KeyboardInterrupt) else error

    def _break(self, error: BaseException) -> None:
        first = self._broken is None
        if first:
            self._broken = error
            logger.warning("%s", error)  # the error names the group
        self._transport.fail(error)  # no-op if already broken; else ABORTs the peers
        self._engine.fail_queued(error)
        for work in self._p2p:
            work._fail(error)
        self._p2p = []
        if first and self.on_break is not None:
            self.on_break(error)

    # -- collectives -------------------------------------------------------------------
    def _reduction(self, op: ReduceOp, dtype: torch.dtype):
        """(fingerprint code, combiner, pre-scale factor or None, divide-by-size?), cached:
        working it out costs a few microseconds, a fifth of a small shared-memory op."""
        return memo(self._reductions, (reduction_key(op), dtype), self._work_out_reduction, op, dtype)

    def _work_out_reduction(self, op: ReduceOp, dtype: torch.dtype):
        kind, factor = as_red_op(op)
        if kind in (RedOpType.SUM, RedOpType.AVG, RedOpType.PREMUL_SUM):
            name = "SUM"
        elif kind is RedOpType.UNUSED:
            raise ValueError(f"{self._label}: ReduceOp.UNUSED is not a reduction")
        else:
            name = kind.name
        premul = factor if kind is RedOpType.PREMUL_SUM else None
        combine = combiner(name, dtype)
        try:  # once per (op, dtype): a dtype torch cannot reduce fails here, before anything is sent
            combine(torch.zeros(1, dtype=dtype), torch.zeros(1, dtype=dtype))
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            raise RuntimeError(f"{self._label}: {kind.name} is not supported for {dtype} tensors: {exc}") from None
        return int(kind), combine, premul, kind is RedOpType.AVG

    def broadcast(self, tensor: torch.Tensor, root: int, *, async_op: bool = False) -> Work:
        fingerprint = OpFingerprint.of(OpKind.BROADCAST, tensor.dtype, tensor.numel(), root)
        return self._collective("broadcast", [tensor], fingerprint,
                                lambda comm: self._algorithms.broadcast(comm, tensor.view(-1), root), async_op)

    def allreduce(self, tensors: list[torch.Tensor], op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False) -> Work:
        code, combine, premul, is_avg = self._reduction(op, tensors[0].dtype)
        fingerprint = allreduce_fingerprint(tensors, code)

        def run(comm: Comm) -> None:
            # Coalesced: one flat buffer, one algorithm run, copied back per tensor.
            flat = flatten(tensors)
            if premul is not None:
                flat.mul_(premul)
            self._algorithms.allreduce(comm, flat, combine, Average(comm.size) if is_avg else None)
            unflatten_into(flat, tensors)
        return self._collective("allreduce", tensors, fingerprint, run, async_op)

    def reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False) -> Work:
        code, combine, premul, is_avg = self._reduction(op, tensor.dtype)
        fingerprint = OpFingerprint.of(OpKind.REDUCE, tensor.dtype, tensor.numel(), root, code)

        def run(comm: Comm) -> None:
            flat = tensor.view(-1)
            if premul is not None:  # in place only on the root: the others' tensor is theirs, read-only
                flat = flat.mul_(premul) if comm.rank == root else flat * premul
            self._algorithms.reduce(comm, flat, root, combine)
            if is_avg and comm.rank == root:
                average(flat, comm.size)
        return self._collective("reduce", [tensor], fingerprint, run, async_op)

    def allgather(self, outputs: list[torch.Tensor], input: torch.Tensor, *, async_op: bool = False) -> Work:
        fingerprint = OpFingerprint.of(OpKind.ALLGATHER, input.dtype, sum(t.numel() for t in outputs))

        def run(comm: Comm) -> None:
            pieces = [t.view(-1) for t in outputs]
            pieces[comm.rank].copy_(input.view(-1))
            self._algorithms.allgather(comm, pieces)
        return self._collective("allgather", outputs, fingerprint, run, async_op)

    def allgather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Work:
        fingerprint = OpFingerprint.of(OpKind.ALLGATHER_INTO_TENSOR, input.dtype, output.numel())

        return self._collective("allgather_into_tensor", [output], fingerprint,
                                lambda comm: self._algorithms.allgather_into(comm, output.view(-1), input.view(-1)),
                                async_op)

    def gather(self, outputs: list[torch.Tensor] | None, input: torch.Tensor, root: int, *,
               async_op: bool = False) -> Work:
        fingerprint = OpFingerprint.of(OpKind.GATHER, input.dtype, input.numel(), root)
        flat_outputs = [t.view(-1) for t in outputs] if outputs else None
        return self._collective("gather", list(outputs or []), fingerprint,
                                lambda comm: self._algorithms.gather(comm, flat_outputs, input.view(-1), root),
                                async_op)

    def scatter(self, output: torch.Tensor, inputs: list[torch.Tensor] | None, root: int, *,
                async_op: bool = False) -> Work:
        fingerprint = OpFingerprint.of(OpKind.SCATTER, output.dtype, output.numel(), root)
        flat_inputs = [t.reshape(-1) for t in inputs] if inputs else None
        return self._collective("scatter", [output], fingerprint,
                                lambda comm: self._algorithms.scatter(comm, output.view(-1), flat_inputs, root),
                                async_op)

    def reduce_scatter(self, output: torch.Tensor, inputs: list[torch.Tensor],
                       op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False) -> Work:
        numel = sum(t.numel() for t in inputs)
        return self._reduce_scatter("reduce_scatter", OpKind.REDUCE_SCATTER, output,
                                    lambda: [t.reshape(-1) for t in inputs], numel, op, async_op)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor,
                              op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False) -> Work:
        def chunks() -> list[torch.Tensor]:
            flat, m = input.view(-1), output.numel()  # the API checked: input = size x output
            return [flat[i * m:(i + 1) * m] for i in range(self._size)]
        return self._reduce_scatter("reduce_scatter_tensor", OpKind.REDUCE_SCATTER_TENSOR, output,
                                    chunks, input.numel(), op, async_op)

    def _reduce_scatter(self, op_name: str, kind: OpKind, output: torch.Tensor,
                        chunks: Callable[[], list[torch.Tensor]], numel: int, op: ReduceOp, async_op: bool) -> Work:
        code, combine, premul, is_avg = self._reduction(op, output.dtype)
        fingerprint = OpFingerprint.of(kind, output.dtype, numel, -1, code)

        def run(comm: Comm) -> None:
            pieces = chunks()
            if premul is not None:  # scale copies: the inputs are the caller's, read-only
                pieces = [piece * premul for piece in pieces]
            flat = output.view(-1)
            self._algorithms.reduce_scatter(comm, pieces, combine, flat)
            if is_avg:
                average(flat, comm.size)
        return self._collective(op_name, [output], fingerprint, run, async_op)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], *, async_op: bool = False) -> Work:
        fingerprint = OpFingerprint.of(OpKind.ALLTOALL, inputs[0].dtype if inputs else None)
        return self._collective("alltoall", outputs, fingerprint, lambda comm: self._algorithms.alltoall(
            comm, [t.view(-1) for t in outputs], [t.reshape(-1) for t in inputs]), async_op)

    def barrier(self, *, async_op: bool = False, timeout: timedelta | None = None) -> Work:
        return self._collective("barrier", [], OpFingerprint.of(OpKind.BARRIER), self._algorithms.barrier, async_op,
                                None if timeout is None else timeout.total_seconds())

    # -- point to point ----------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, async_op: bool = False) -> Work:
        return self._point_to_point("send", tensor, dst, tag, True, async_op)

    def recv(self, tensor: torch.Tensor, src: int | None, tag: int, *, async_op: bool = False) -> Work:
        return self._point_to_point("recv", tensor, src, tag, False, async_op)

    def _point_to_point(self, op_name: str, tensor: torch.Tensor, peer: int | None, tag: int,
                        is_send: bool, async_op: bool) -> Work:
        def body(work: _OpWork, seq: int) -> None:
            view = byte_view(tensor)
            if is_send:
                transfer = self._transport.isend(peer, MsgKind.P2P, seq, OpFingerprint(), view, tag)
            else:
                transfer = self._transport.irecv(peer, MsgKind.P2P, seq, OpFingerprint(), view, tag)
            work._deadline = time.monotonic() + self._seconds
            work._transfer = transfer

            def done(t: Transfer) -> None:
                if t.error is None:
                    work._complete(source_rank=None if is_send else t.source)
                else:  # the transport broke while this transfer was pending
                    work._fail(self._failure(t.error, op_name, None))
            transfer.on_done = done
            if transfer.done:
                done(transfer)
            else:
                self._p2p.append(work)
                self._p2p_due = min(self._p2p_due, work._deadline)
        return self._issue_op(op_name, [tensor], False, body, async_op=async_op)

    def _drive_p2p(self, work: _OpWork, until: float | None = None) -> None:
        """Drive ``work``'s transfer until its deadline, or ``until`` if that is sooner."""
        caller_limit = until is not None and until < work._deadline
        try:
            self._transport.wait([work._transfer], until if caller_limit else work._deadline)
        except PeerTimeout as exc:
            if not caller_limit:  # else the caller's wait gave up, not the op: Work.wait says so
                work._fail(self._failure(exc, work.op_name, None))
        except BaseException as exc:  # noqa: BLE001
            work._fail(self._failure(exc, work.op_name, None))
        if self._p2p and self._p2p[-1] is work and work._done.is_set():
            self._p2p.pop()  # a synchronous send/recv: forgotten at once, sweep or not
        if time.monotonic() - self._p2p_swept >= _SWEEP_S:
            self._sweep_p2p()

    def _idle_step(self) -> None:
        """The worker's step while only P2P transfers are pending: progress, enforce deadlines."""
        try:
            self._transport.progress(max(0.0, min(0.05, self._p2p_due - time.monotonic())))
        except BaseException as exc:  # noqa: BLE001
            self._failure(exc, "progress", None)
            return
        now = time.monotonic()
        if now - self._p2p_swept >= _SWEEP_S or now >= self._p2p_due:
            self._sweep_p2p()

    def _sweep_p2p(self) -> None:
        """Forget the P2P works that finished; fail the group if one is past its deadline.

        On the driving thread, at most every ``_SWEEP_S`` (and at the earliest deadline):
        a sweep costs O(works posted), and one per message made thousands of pending
        sends quadratic."""
        now = self._p2p_swept = time.monotonic()
        self._p2p = [w for w in self._p2p if not w._done.is_set()]
        self._p2p_due = min((w._deadline for w in self._p2p), default=math.inf)
        for work in self._p2p:
            if not work._transfer.done and work._deadline <= now:
                peer = work._transfer.peer
                self._failure(PeerTimeout("p2p", [] if peer is None else [peer]), work.op_name, None)
                break

    def fail(self, op_name: str, error: DistBackendError) -> None:
        def body(work: _OpWork, seq: int) -> None:
            raise error  # _failure breaks the group, on the thread that drives the transport
        try:
            self._issue_op(op_name, [], False, body).wait()
        except DistError:
            pass  # ``error``, or the group was broken already

    # -- lifecycle ---------------------------------------------------------------------
    def shutdown(self) -> None:
        """Let queued and running ops finish (within their timeouts: gloo's destructor,
        too, waits for its queue), then close."""
        self._engine.settle(self._seconds + _SETTLE_SLACK_S)
        self._close(DistBackendError(f"{self._label}: {self._me()} shut the group down"), notify=False)

    def abort(self) -> None:
        self._close(DistBackendError(f"{self._label}: {self._me()} aborted the group"), notify=True)

    def quiesce(self) -> None:
        if os.getpid() != self._pid:
            return  # a forked child's copy: the ops and threads are the parent's
        self._engine.settle(self._seconds + _SETTLE_SLACK_S)
        self._engine.close(DistBackendError(f"{self._label}: {self._me()}: the process is exiting"))

    def _close(self, error: DistBackendError, notify: bool) -> None:
        """Fail what is queued, stop the worker, and release the transport once no thread
        is inside it: a thread still there (waiting for a message, or in an op of its
        own) is made to raise first. Shared memory unmapped under it would crash it.

        ``notify``: ABORT the peers. A clean shutdown does not: peers waiting on this
        rank see it leave, the others go on with their own traffic (the worker may
        still be in its last progress step after a send this rank waited for)."""
        if self._broken is None:
            self._broken = error
        if not self._engine.settle(0.0, transfers_count=True):
            self._transport.fail(error, notify)  # the thread inside raises
        self._engine.close(error)
        if not self._engine.settle(_LEAVE_S, transfers_count=True):
            logger.warning("%s: a thread is still inside the group's transport %.0f s after it was told to "
                           "leave; its resources stay allocated until the process exits", self._label, _LEAVE_S)
            return
        self._transport.close()
        self._scratch.release()
