"""Run a function on N processes, one per rank: the harness of torchdist's tests.

``run_ranks(fn, world_size)`` is torchdist's answer to PyTorch's
``MultiProcessTestCase``, as a plain function: it starts ``world_size``
processes, calls ``fn(rank, world_size, *args, **kwargs)`` in each, and
returns their results in rank order, or raises :class:`RanksFailed` with a
report that says what every failed rank did.

Fast starts: a fork server
--------------------------
Importing torch costs over a second per process, and the test suite starts
thousands of ranks. So ranks are started with multiprocessing's "forkserver"
method: a server process, started on the first call and kept for the life of
the test process, imports torch, the worker module and (under pytest) pytest
once (``set_forkserver_preload``); each rank is then a ``fork()`` of that
server, which costs milliseconds, and never a fork of the test process
itself, with its threads and locks. What a fork shares that a fresh process
would not (environment, random seeds, stdout) is undone in ``_worker.py``;
``_forkserver.py`` freezes the garbage collector over torch's objects so that
collections in the ranks do not copy the inherited heap.

Measured on the 2-core development machine, under pytest, after the first
call (which starts the fork server: about 1 s), for a ``fn`` that returns at
once: 13 ms for 1 rank, 16 ms for 2, 28 ms for 4, 55 ms for 8. A fresh
``python -c "import torch"`` costs 1.3 s per rank.

The preload applies only if this module starts the fork server; a process
that started it earlier without the preload gets correct but slow ranks.

The life of one call
--------------------
::

    start every rank ──► wait for the ranks' reports
      ├─ every rank reported ─────────────────────────────► reap
      ├─ a rank raised or died ──► wait up to `grace` more, then
      │                            dump the stacks of the rest and kill them
      └─ `timeout` passed ───────► dump the stacks of the rest and kill them
    reap: a rank that reported but has not exited `grace` s later
          (a non-daemon thread left running?) is dumped and killed
    finally, also on KeyboardInterrupt: SIGTERM, SIGKILL after a short
          wait, and join, for every rank still alive; then SIGKILL for
          what is left of each rank's OS process group (each rank leads
          one), so that processes started by a rank do not outlive it

Stacks are dumped by sending SIGUSR1, on which each rank has armed
:func:`faulthandler.register` to write all its threads' stacks to a per-rank
file; the report shows them with their source lines.

What can become of a rank, and the report of it, is in ``_report.py``.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from typing import Any, Callable

from . import _worker
from ._report import RankOutcome, RanksFailed, RankStatus, describe_exit, format_report, tidy_stacks

__all__ = ["RankOutcome", "RankStatus", "RanksFailed", "free_port", "run_ranks"]

_log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 3.0
"""How long the other ranks may go on after one rank failed; also how long a
rank that reported may take to exit. Peers of a dead rank usually fail on
their own within this time, and their errors are worth reporting too."""

_DUMP_WAIT_S = 1.0  # longest wait for the stack dumps of ranks about to be killed
_TERM_WAIT_S = 0.5  # from SIGTERM to SIGKILL
_JOIN_WAIT_S = 5.0  # a SIGKILLed process that takes longer is logged, not waited for


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago.

    The socket is closed before returning, so another process may take the
    port first; with the kernel's randomized ephemeral ports that is rare.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float = 60.0,
    backend: str | None = None,
    init_method: str | None = None,
    env: dict[str, str] | None = None,
    grace: float = DEFAULT_GRACE_S,
) -> list:
    """Run fn(rank, world_size, *args, **kwargs) on world_size spawned processes; return their results in rank order.

    ``fn`` must be picklable by reference: a module-level function. ``args``,
    ``kwargs`` and the return values are pickled (tensors included).

    Each rank sees the test process's environment plus ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR=127.0.0.1`` and ``MASTER_PORT`` (a free port chosen for this
    call), then ``env`` on top. With a ``backend``, each rank calls
    ``torchdist.init_process_group(backend, init_method or "env://", rank,
    world_size)`` before ``fn`` and ``destroy_process_group()`` after it. The
    ranks' stdout and stderr are the test process's (pytest captures them).

    Raises :class:`RanksFailed` if any rank raises or dies, if ranks are still
    running ``timeout`` seconds after the start, or ``grace`` seconds after
    another rank failed, or if a rank has not exited ``grace`` seconds after
    returning. Every rank is dead and joined when this function returns or
    raises, whatever happened.
    """
    kwargs = dict(kwargs or {})
    env = dict(env or {})
    _check_arguments(fn, world_size, timeout, grace, env)
    label = f"run_ranks({_worker.qualified_name(fn)}, world_size={world_size})"

    port = free_port()
    stacks_dir = tempfile.mkdtemp(prefix="torchdist-ranks-")
    base_env = dict(os.environ)
    log_level = logging.getLogger().getEffectiveLevel()  # ranks log as the test process does
    specs = []
    for rank in range(world_size):
        environ = dict(base_env)
        environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        environ.update(env)
        specs.append(
            _worker.WorkerSpec(
                rank=rank,
                world_size=world_size,
                fn=fn,
                args=tuple(args),
                kwargs=kwargs,
                backend=backend,
                init_method=init_method,
                environ=environ,
                stacks_path=os.path.join(stacks_dir, f"rank{rank}.stacks"),
                log_level=log_level,
            )
        )

    ranks = _Ranks(_forkserver_context(), specs, label)
    try:
        ranks.start()
        ranks.collect(timeout=timeout, grace=grace)
        ranks.reap(grace=grace)
    finally:
        ranks.close()
        shutil.rmtree(stacks_dir, ignore_errors=True)

    outcomes = ranks.outcomes()
    if all(o.ok for o in outcomes):
        return [o.result for o in outcomes]
    raise RanksFailed(format_report(label, outcomes), outcomes)


class _Ranks:
    """The processes of one :func:`run_ranks` call, and what became of each."""

    def __init__(self, ctx: ForkServerContext, specs: list[_worker.WorkerSpec], label: str) -> None:
        self._ctx = ctx
        self._specs = specs
        self._label = label
        self._procs: list[BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._outcomes: dict[int, RankOutcome] = {}

    # -- start ---------------------------------------------------------------

    def start(self) -> None:
        """Start every rank. Pickling errors of ``args`` propagate as they are."""
        began = time.monotonic()
        stdout, stderr = _current_stdio()
        for spec in self._specs:
            recv, send = self._ctx.Pipe(duplex=False)
            self._conns.append(recv)
            proc = self._ctx.Process(
                target=_worker.worker_main,
                args=(spec, send, stdout, stderr),
                name=f"rank{spec.rank}",
                # Not daemonic: daemonic processes may not start processes,
                # and tests of launchers and DataLoaders need to.
                daemon=False,
            )
            try:
                proc.start()
            except (OSError, EOFError) as exc:
                raise RanksFailed(
                    f"{self._label}: could not start rank {spec.rank}: {exc!r}. The fork "
                    "server may have died while preloading; `python -c 'import torch, "
                    "torchdist.testing'` shows whether the imports work."
                ) from exc
            finally:
                send.close()  # the rank holds the only write end: EOF means it is gone
            self._procs.append(proc)
        _log.debug("%s: started in %.3f s", self._label, time.monotonic() - began)

    # -- wait ----------------------------------------------------------------

    def collect(self, *, timeout: float, grace: float) -> None:
        """Wait for every rank's report, then kill the ranks that are too late."""
        deadline = time.monotonic() + timeout
        first_failure: int | None = None
        failed_at = 0.0
        pending = set(range(len(self._procs)))
        eof: set[int] = set()  # ranks whose result pipe is closed: wait for the exit
        while pending:
            limit = deadline if first_failure is None else min(deadline, failed_at + grace)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            waitables: dict[Any, int] = {}
            for rank in pending:
                waitables[self._procs[rank].sentinel] = rank
                if rank not in eof:
                    waitables[self._conns[rank]] = rank
            for ready in multiprocessing.connection.wait(list(waitables), remaining):
                rank = waitables[ready]
                if rank not in pending:
                    continue
                outcome = self._receive(rank, exited=ready is self._procs[rank].sentinel)
                if outcome is None:
                    eof.add(rank)
                    continue
                pending.discard(rank)
                self._outcomes[rank] = outcome
                if not outcome.ok and first_failure is None:
                    first_failure, failed_at = rank, time.monotonic()
        if not pending:
            return

        if first_failure is not None and failed_at + grace < deadline:
            why = f"still running {grace:.1f} s after rank {first_failure} failed"
        else:
            why = f"still running at the {timeout:.1f} s timeout"
        late = sorted(pending)
        _log.debug("%s: ranks %s %s; killing them", self._label, late, why)
        self._dump_stacks(late)
        self._kill(late)
        for rank in late:
            self._outcomes[rank] = RankOutcome(
                rank, RankStatus.STILL_RUNNING, summary=why, stacks=self._read_stacks(rank)
            )

    def _receive(self, rank: int, *, exited: bool) -> RankOutcome | None:
        """The outcome of a rank whose pipe or sentinel is ready; None: wait for its exit."""
        conn = self._conns[rank]
        try:
            payload = conn.recv_bytes() if conn.poll() else None
        except (EOFError, OSError):
            payload = None
        if payload is not None:
            return self._decode(rank, payload)
        if not exited:
            return None  # EOF on the pipe; the sentinel will tell how it ended
        proc = self._procs[rank]
        proc.join()
        return RankOutcome(
            rank,
            RankStatus.DIED,
            summary=f"died without reporting: {describe_exit(proc.exitcode)}",
            stacks=self._read_stacks(rank),
        )

    def _decode(self, rank: int, payload: bytes) -> RankOutcome:
        try:
            report: _worker.Report = pickle.loads(payload)
        except Exception as exc:  # noqa: BLE001 - becomes this rank's failure
            import traceback

            return RankOutcome(
                rank,
                RankStatus.RAISED,
                summary=f"returned a value the test process cannot unpickle: {exc!r}",
                traceback="".join(traceback.format_exception(exc)),
            )
        if report.ok:
            return RankOutcome(rank, RankStatus.RETURNED, result=report.result)
        return RankOutcome(
            rank, RankStatus.RAISED, summary=f"raised {report.error}", traceback=report.traceback
        )

    # -- reap ----------------------------------------------------------------

    def reap(self, *, grace: float) -> None:
        """Join the ranks that reported; dump and kill those that do not exit."""
        deadline = time.monotonic() + grace
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        lingering = [rank for rank, proc in enumerate(self._procs) if proc.is_alive()]
        if not lingering:
            return
        _log.debug("%s: ranks %s reported but did not exit; killing them", self._label, lingering)
        self._dump_stacks(lingering)
        self._kill(lingering)
        for rank in lingering:
            if self._outcomes[rank].ok:
                self._outcomes[rank] = RankOutcome(
                    rank,
                    RankStatus.DID_NOT_EXIT,
                    summary=(
                        f"returned but had not exited {grace:.1f} s later "
                        "(a non-daemon thread or child process left running?)"
                    ),
                    stacks=self._read_stacks(rank),
                )

    def close(self) -> None:
        """Kill and join whatever is still alive, and release the pipes.

        Also SIGKILLs what is left of each rank's OS process group (each rank
        leads its own): processes a rank started and did not wait for would
        otherwise outlive the test.
        """
        alive = [rank for rank, proc in enumerate(self._procs) if proc.is_alive()]
        if alive:
            _log.debug("%s: cleaning up ranks %s", self._label, alive)
            self._kill(alive)
        for proc in self._procs:
            if proc.pid is not None and _kill_group(proc.pid, signal.SIGKILL):
                _log.warning(
                    "%s: %s left processes running in its OS process group; killed them",
                    self._label,
                    proc.name,
                )
            if proc.exitcode is not None:
                proc.close()
        for conn in self._conns:
            conn.close()

    def outcomes(self) -> list[RankOutcome]:
        return [self._outcomes[rank] for rank in range(len(self._specs))]

    # -- signals -------------------------------------------------------------

    def _dump_stacks(self, ranks: list[int]) -> None:
        """Ask ``ranks`` to write their stacks (SIGUSR1) and wait until they have."""
        sizes = {rank: self._stacks_size(rank) for rank in ranks}
        for rank in ranks:
            _signal(self._procs[rank], signal.SIGUSR1)
        deadline = time.monotonic() + _DUMP_WAIT_S
        waiting = set(ranks)
        while waiting and time.monotonic() < deadline:
            time.sleep(0.02)
            for rank in list(waiting):
                size = self._stacks_size(rank)
                if size > sizes[rank]:
                    waiting.discard(rank)  # started writing; the dump is one burst
        time.sleep(0.02)  # let the last bursts finish

    def _kill(self, ranks: list[int]) -> None:
        """SIGTERM, SIGKILL after a short wait, join: ``ranks`` are gone after this."""
        procs = [self._procs[rank] for rank in ranks]
        for proc in procs:
            _signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + _TERM_WAIT_S
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                _signal(proc, signal.SIGKILL)
        for proc in procs:
            proc.join(_JOIN_WAIT_S)
            if proc.is_alive():
                _log.error("%s: %s (pid %s) survived SIGKILL", self._label, proc.name, proc.pid)

    def _stacks_size(self, rank: int) -> int:
        try:
            return os.path.getsize(self._specs[rank].stacks_path)
        except OSError:
            return 0

    def _read_stacks(self, rank: int) -> str:
        try:
            with open(self._specs[rank].stacks_path, encoding="utf-8", errors="replace") as f:
                return tidy_stacks(f.read())
        except OSError:
            return ""


# -- helpers ---------------------------------------------------------------

_context_lock = threading.Lock()
_context: ForkServerContext | None = None


def _forkserver_context() -> ForkServerContext:
    """The forkserver context, with torch and the worker module preloaded."""
    global _context
    with _context_lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            assert isinstance(ctx, ForkServerContext)
            # The fork server imports these once; every rank forked from it
            # gets them for free. pytest, because test modules, which every
            # rank imports to find fn, import it. The fork server swallows
            # an ImportError here; each rank then fails on the same import.
            # _forkserver comes last: it freezes the gc over all of the above.
            preload = ["torch"]
            if "pytest" in sys.modules:
                preload.append("pytest")
            preload += [_worker.__name__, f"{__package__}._forkserver"]
            ctx.set_forkserver_preload(preload)
            _context = ctx
        return _context


def _current_stdio() -> tuple[_worker.InheritedFd | None, _worker.InheritedFd | None]:
    """fds 1 and 2 of this process, to be duplicated into each rank, flushed first."""
    fds: list[_worker.InheritedFd | None] = []
    for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
        if stream is not None:
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        try:
            os.fstat(fd)
        except OSError:
            fds.append(None)
        else:
            fds.append(_worker.InheritedFd(fd))
    return fds[0], fds[1]


def _signal(proc: BaseProcess, sig: signal.Signals) -> None:
    """Send ``sig`` to a rank; SIGTERM and SIGKILL to its whole OS process group."""
    if proc.pid is None:
        return
    if sig in (signal.SIGTERM, signal.SIGKILL) and _kill_group(proc.pid, sig):
        return
    # Not (yet) a group leader, or only the rank itself should get the signal:
    # SIGUSR1 would kill the rank's children, which have no handler for it.
    if proc.exitcode is None:
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass


def _kill_group(pgid: int, sig: signal.Signals) -> bool:
    """``killpg``; False if no process is left in the group."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _check_arguments(
    fn: Callable[..., Any], world_size: int, timeout: float, grace: float, env: dict[str, str]
) -> None:
    if not callable(fn):
        raise TypeError(f"run_ranks: fn must be callable, got {type(fn).__name__}")
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise TypeError(
            f"run_ranks: fn={fn!r} cannot be pickled by reference; define it at module "
            "level (not a lambda, a closure or a method of a test class instance)"
        ) from exc
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"run_ranks: world_size must be an int, got {type(world_size).__name__}")
    if world_size < 1:
        raise ValueError(f"run_ranks: world_size must be at least 1, got {world_size}")
    if not timeout > 0:
        raise ValueError(f"run_ranks: timeout must be positive, got {timeout}")
    if not grace >= 0:
        raise ValueError(f"run_ranks: grace must be non-negative, got {grace}")
    for key, value in env.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(
                f"run_ranks: env must map str to str, got {key!r}: {type(value).__name__}"
            )

