"""The worker side of :func:`torchdist.testing.run_ranks`: what one rank runs.

A rank is a fork of the harness's fork server (see ``harness.py``), which has
already imported torch and this module. :func:`worker_main` turns that fork
into a clean, fresh-looking rank and reports exactly one result:

1. Lead an OS process group of its own, so that the harness can kill what
   the rank started along with it.
2. Die with the parent. The test process is not this process's parent (the
   fork server is), so two mechanisms are needed: a watchdog thread (named
   ``torchdist-parent-watchdog``, a daemon) waits on multiprocessing's parent
   sentinel, a pipe that reaches EOF when the test process dies for any
   reason (SIGKILL, ``os._exit`` from pytest-timeout); and
   ``PR_SET_PDEATHSIG`` makes the kernel SIGKILL the rank if the fork server
   dies.
3. Adopt the stdout/stderr the test process has *now* (under pytest, the
   capture file of the running test), not the ones the fork server inherited
   when it started, so that a failing test shows its ranks' output.
4. Arm faulthandler on a per-rank file: fatal signals (SIGSEGV, SIGABRT, ...)
   dump the stacks there, and so does SIGUSR1, which the harness sends to a
   rank right before killing it. The harness puts those stacks in its
   failure report.
5. Undo what the fork shares: the environment becomes the test process's
   current one plus the rendezvous variables; torch's global generator, and
   numpy's if the fork server imported ``numpy.random``, are reseeded from OS
   entropy, as in a freshly started interpreter (``random`` is reseeded by
   CPython at fork). Without this every rank, in every call, would draw the
   same "random" numbers. Ctrl-C (SIGINT) raises ``KeyboardInterrupt``, as in
   an interpreter started from a terminal, even when the test process was
   started with SIGINT ignored (a background job of a non-interactive shell:
   the fork server, and every rank, would inherit that).
6. Optionally ``init_process_group`` (torchdist is imported only then), call
   ``fn(rank, world_size, *args, **kwargs)``, ``destroy_process_group``.
7. Send one report over the result pipe, pickled with plain :mod:`pickle`:
   tensors travel by value. (multiprocessing's own pickler would share tensor
   storage through file descriptors that die with this process.)

torch's intra-op thread pool keeps torch's default size (one thread per core)
so that ranks behave as they would under a launcher without
``OMP_NUM_THREADS``. Because torch was imported before the fork, setting
``OMP_NUM_THREADS`` in the rank's environment has no effect by itself; when
the requested environment changes it, the rank calls ``torch.set_num_threads``.

This module imports only the standard library, so that the fork server can
preload it cheaply.
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.reduction
import os
import pickle
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import IO, Any, Callable

__all__ = ["InheritedFd", "Report", "WorkerSpec", "watch_parent", "worker_main"]

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>

# The per-rank faulthandler file must stay open for the life of the rank:
# faulthandler writes to its file descriptor from a signal handler.
_stacks_file: IO[str] | None = None


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one rank needs, sent to it pickled when it starts."""

    rank: int
    world_size: int
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    backend: str | None
    init_method: str | None
    environ: dict[str, str]
    stacks_path: str
    log_level: int = logging.WARNING


@dataclass(frozen=True)
class Report:
    """What a rank sends back: its return value, or the exception it raised."""

    ok: bool
    result: Any = None
    error: str = ""  # "ValueError: boom", the one-line summary
    traceback: str = ""  # the full formatted traceback


class InheritedFd:
    """A file descriptor of the test process, duplicated into the rank at start.

    Pickling it is only possible while multiprocessing starts a process: the
    fork server then passes the descriptor along with the process data
    (SCM_RIGHTS), and the rank receives its own copy.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Callable[[Any], InheritedFd], tuple[Any]]:
        return _adopt_fd, (multiprocessing.reduction.DupFd(self.fd),)


def _adopt_fd(dup: Any) -> InheritedFd:
    return InheritedFd(dup.detach())


def worker_main(
    spec: WorkerSpec,
    result_conn: multiprocessing.connection.Connection,
    stdout: InheritedFd | None,
    stderr: InheritedFd | None,
) -> None:
    """Run one rank and send its :class:`Report` to the test process.

    Every exception, including one raised while setting the rank up, and
    ``SystemExit`` or ``KeyboardInterrupt`` raised by ``fn``, becomes a report
    with its traceback; nothing is raised out of this function.
    """
    try:
        # Lead an OS process group of our own: the harness kills the group,
        # and so whatever fn started and left running. (It also keeps a
        # Ctrl-C in the terminal for the test process, which kills the ranks.)
        os.setpgid(0, 0)
        _die_with_parent()
        _adopt_stdio(stdout, stderr)
        _arm_stack_dumps(spec.stacks_path)
        _reset_inherited_state(spec)
        result = _call(spec)
        try:
            payload = pickle.dumps(Report(ok=True, result=result), pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise TypeError(
                f"the return value of {qualified_name(spec.fn)} "
                f"({type(result).__name__}) cannot be pickled back to the test process"
            ) from exc
    except BaseException as exc:  # noqa: BLE001 - the report is the point
        payload = pickle.dumps(
            Report(
                ok=False,
                error=_one_line(exc),
                traceback="".join(traceback.format_exception(_without_own_frames(exc))),
            ),
            pickle.HIGHEST_PROTOCOL,
        )
    result_conn.send_bytes(payload)
    result_conn.close()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()


def _call(spec: WorkerSpec) -> Any:
    """``fn(rank, world_size, *args, **kwargs)``, in a torchdist process group if asked."""
    if spec.backend is None:
        return spec.fn(spec.rank, spec.world_size, *spec.args, **spec.kwargs)
    import torchdist  # only here: the harness itself must not need it

    torchdist.init_process_group(
        backend=spec.backend,
        init_method=spec.init_method or "env://",
        rank=spec.rank,
        world_size=spec.world_size,
    )
    try:
        return spec.fn(spec.rank, spec.world_size, *spec.args, **spec.kwargs)
    finally:
        if torchdist.is_initialized():  # fn may have destroyed it already
            torchdist.destroy_process_group()


def _die_with_parent() -> None:
    """Make sure this rank does not outlive the test process (see module docstring)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            logging.getLogger(__name__).debug(
                "prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno()
            )
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(
            target=watch_parent,
            args=(parent.sentinel,),
            name="torchdist-parent-watchdog",
            daemon=True,
        ).start()


def watch_parent(sentinel: int) -> None:
    """The watchdog thread: exit as soon as the test process is gone.

    Named so that the harness can leave this thread out of stack dumps.
    """
    multiprocessing.connection.wait([sentinel])
    os._exit(70)  # EX_SOFTWARE; nobody is left to read it


def _adopt_stdio(stdout: InheritedFd | None, stderr: InheritedFd | None) -> None:
    """Point fds 1 and 2 where the test process's are pointing now."""
    for inherited, target, stream in ((stdout, 1, sys.stdout), (stderr, 2, sys.stderr)):
        if inherited is None:
            continue
        if stream is not None:
            stream.flush()
        os.dup2(inherited.fd, target)
        os.close(inherited.fd)
    # Line buffering, so that a rank killed at a timeout has shown what it printed.
    if sys.stdout is not None and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)


def _arm_stack_dumps(path: str) -> None:
    """Dump all threads' stacks to ``path`` on a fatal signal or on SIGUSR1."""
    global _stacks_file
    _stacks_file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - kept open on purpose
    faulthandler.enable(file=_stacks_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=_stacks_file, all_threads=True, chain=False)


def _reset_inherited_state(spec: WorkerSpec) -> None:
    """Environment, random generators, threads, SIGINT and logging, as for a fresh process."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    old_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ.clear()
    os.environ.update(spec.environ)

    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()
        new_threads = os.environ.get("OMP_NUM_THREADS")
        if new_threads != old_threads and new_threads and new_threads.isdigit():
            torch.set_num_threads(int(new_threads))
    # Only if the fork server imported it: numpy.random is imported lazily,
    # and a rank that imports it later seeds it from OS entropy by itself.
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()

    logging.basicConfig(
        level=spec.log_level,
        format=f"[rank {spec.rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def _without_own_frames(exc: BaseException) -> BaseException:
    """``exc`` with this module's outer frames cut from its traceback, when it
    was raised below them: the report should start at ``fn``."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return exc if tb is None else exc.with_traceback(tb)


def _one_line(exc: BaseException) -> str:
    """``"ValueError: boom"``: the exception's type and the first line of its message."""
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not lose the report
        message = "<str() failed>"
    lines = message.strip().splitlines()
    first = lines[0] if lines else ""
    if len(lines) > 1:
        first += " ..."
    return f"{type(exc).__qualname__}: {first}" if first else type(exc).__qualname__


def qualified_name(fn: Callable[..., Any]) -> str:
    """``module.qualname`` of ``fn``, for reports."""
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
