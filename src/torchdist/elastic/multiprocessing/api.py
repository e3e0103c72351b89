"""Start, watch and stop the worker processes of one node (torch.distributed.elastic.multiprocessing.api).

::

    PContext                 name, entrypoint, args/envs by local rank, LogsSpecs -> start / wait / pids / close
     ├── SubprocessContext   the entrypoint is an executable: ``entrypoint *args[r]`` per local rank
     └── MultiprocessContext the entrypoint is a function: ``entrypoint(*args[r])``, return values kept

:meth:`PContext.wait` returns ``None`` while every worker runs, else a
:class:`RunProcsResult` as soon as all succeeded or one failed; in the second case
the others are stopped first (as torch's). Unlike torch, a worker this context
stopped is not listed as a failure: only the workers that failed on their own are.

A function runs in a fresh interpreter (:mod:`~torchdist.elastic.function_worker`),
whatever ``start_method`` says: this keeps one process model (process groups, no
orphans, the output copier) for both kinds, at the cost of ``"fork"``'s shared
memory. The function and its arguments must be picklable, as with ``"spawn"``.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import multiprocessing.spawn
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Callable

from ._std import Std, to_map
from .errors import ProcessFailure
from .logs_specs import DefaultLogsSpecs, LogsDest, LogsSpecs
from .subprocess_handler import SubprocessHandler

__all__ = ["DefaultLogsSpecs", "LogsDest", "LogsSpecs", "MultiprocessContext", "PContext", "RunProcsResult",
           "SignalException", "Std", "SubprocessContext", "get_std_cm", "to_map"]

log = logging.getLogger(__name__)

_START_METHODS = ("spawn", "fork", "forkserver")


class SignalException(Exception):
    """The launcher received ``sigval``; its workers are stopped with the same signal."""

    def __init__(self, msg: str, sigval: signal.Signals) -> None:
        super().__init__(msg)
        self.sigval = sigval


def _terminate_process_handler(signum: int, frame: FrameType | None) -> None:
    sigval = signal.Signals(signum)
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)


def _install_signal_handlers() -> None:
    """torch's: the signals of ``$TORCHELASTIC_SIGNALS_TO_HANDLE`` raise :class:`SignalException`.

    Only where no handler of the program's own is installed (the agent installs one that
    also survives a second signal while stopping), and only from the main thread.
    """
    if threading.current_thread() is not threading.main_thread():
        log.warning("started from a child thread: no signal handlers; a killed launcher may orphan workers")
        return
    for name in os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT").split(","):
        sig = getattr(signal, name.strip(), None)
        if sig is None:
            log.warning("Failed to register signal handler for %s", name)
        elif signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
            signal.signal(sig, _terminate_process_handler)


def get_std_cm(std_rd: str, redirect_fn: Callable[[str], Any]) -> Any:
    """``redirect_fn(std_rd)`` (a context manager redirecting a stream to the file ``std_rd``), or a no-op
    context when there is no file (torch's helper)."""
    if not std_rd or sys.platform in ("win32", "darwin"):  # as torch's: no fd-level redirect there
        return contextlib.nullcontext()
    return redirect_fn(std_rd)


def _validate_full_rank(d: dict[int, Any], nprocs: int, what: str) -> None:
    if set(d) != set(range(nprocs)):
        raise RuntimeError(f"{what}, local rank mapping mismatch, expected: {nprocs}, actual: {len(d)}")


@dataclass
class RunProcsResult:
    """The outcome of a finished group, by local rank: ``failures`` is empty on success; ``stdouts`` /
    ``stderrs`` name each rank's log file ("" where the stream was not redirected)."""

    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)

    def is_failed(self) -> bool:
        return bool(self.failures)


class PContext(abc.ABC):
    """A set of worker processes started together; see the module docstring."""

    def __init__(self, name: str, entrypoint: Callable | str, args: dict[int, tuple], envs: dict[int, dict[str, str]],
                 logs_specs: LogsSpecs, log_line_prefixes: dict[int, str] | None = None,
                 duplicate_stdout_filters: list[str] | None = None,
                 duplicate_stderr_filters: list[str] | None = None) -> None:
        self.name = name
        self.nprocs = len(args)
        _validate_full_rank(args, self.nprocs, "args")
        _validate_full_rank(envs, self.nprocs, "envs")
        self.entrypoint = entrypoint
        self.args = args
        self.envs = envs
        self._dest: LogsDest = logs_specs.reify(envs)
        _validate_full_rank(self._dest.stdouts, self.nprocs, "stdouts")
        _validate_full_rank(self._dest.stderrs, self.nprocs, "stderrs")
        self.stdouts = self._dest.stdouts
        self.stderrs = self._dest.stderrs
        self.error_files = self._dest.error_files
        self._prefixes = log_line_prefixes or {}
        self._filters = {"out": (self._dest.filtered_stdout, tuple(duplicate_stdout_filters or ())),
                         "err": (self._dest.filtered_stderr, tuple(duplicate_stderr_filters or ()))}
        #: Seconds the workers get between the death signal and SIGKILL when ``wait`` stops them.
        self.shutdown_timeout: float = 30.0

    def start(self) -> None:
        """Start the processes (once)."""
        _install_signal_handlers()
        self._start()

    @abc.abstractmethod
    def _start(self) -> None: ...

    @abc.abstractmethod
    def _poll(self) -> RunProcsResult | None: ...

    def wait(self, timeout: float = -1, period: float = 1) -> RunProcsResult | None:
        """Poll every ``period`` s until done; ``None`` if still running after ``timeout`` (< 0: for ever, 0: once)."""
        if timeout == 0:
            return self._poll()
        deadline = None if timeout < 0 else time.monotonic() + timeout
        while True:
            result = self._poll()
            if result is not None:
                return result
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(period)

    @abc.abstractmethod
    def pids(self) -> dict[int, int]:
        """The pid of each local rank."""

    @abc.abstractmethod
    def _close(self, death_sig: signal.Signals, timeout: float = 30) -> None: ...

    def close(self, death_sig: signal.Signals | None = None, timeout: float = 30) -> None:
        """Stop every process (and what it forked): ``death_sig`` (SIGTERM), then SIGKILL after ``timeout`` s."""
        self._close(death_sig or signal.SIGTERM, timeout)


class _ProcessesContext(PContext):
    """What both kinds share: one :class:`SubprocessHandler` per local rank running :meth:`_argv`."""

    def __init__(self, name: str, entrypoint: Callable | str, args: dict[int, tuple],
                 envs: dict[int, dict[str, str]], logs_specs: LogsSpecs, log_line_prefixes: dict[int, str] | None,
                 duplicate_stdout_filters: list[str] | None, duplicate_stderr_filters: list[str] | None) -> None:
        super().__init__(name, entrypoint, args, envs, logs_specs, log_line_prefixes, duplicate_stdout_filters,
                         duplicate_stderr_filters)
        self.subprocess_handlers: dict[int, SubprocessHandler] = {}
        self._closed = False

    def _argv(self, local_rank: int) -> tuple[str, ...]:
        return (str(self.entrypoint), *(str(a) for a in self.args[local_rank]))

    def _start(self) -> None:
        if self.subprocess_handlers:
            raise ValueError("The subprocess handlers already initialized. Most likely the start method got "
                             "called twice.")
        for rank in range(self.nprocs):
            if self.error_files.get(rank) and os.path.isfile(self.error_files[rank]):
                os.remove(self.error_files[rank])  # a stale file would pose as this attempt's error
            self.subprocess_handlers[rank] = SubprocessHandler(
                rank, self._argv(rank), self.envs[rank], stdout=self.stdouts[rank], stderr=self.stderrs[rank],
                tee_stdout=rank in self._dest.tee_stdouts, tee_stderr=rank in self._dest.tee_stderrs,
                prefix=self._prefixes.get(rank, ""), duplicate=self._filters)
        log.debug("started %s: pids %s", self.name, self.pids())

    def pids(self) -> dict[int, int]:
        return {rank: handler.proc.pid for rank, handler in self.subprocess_handlers.items()}

    def _poll(self) -> RunProcsResult | None:
        failures: dict[int, ProcessFailure] = {}
        running = 0
        for rank, handler in self.subprocess_handlers.items():
            code = handler.proc.poll()
            if code is None:
                running += 1
            elif code != 0:
                failures[rank] = ProcessFailure(rank, handler.proc.pid, code, self.error_files.get(rank, ""))
        if failures:
            self.close(timeout=self.shutdown_timeout)  # the rest of the group stops with the failure (torch's)
            for rank, failure in failures.items():
                log.error("failed (exitcode: %d) local_rank: %d (pid: %d) of %s",
                          failure.exitcode, rank, failure.pid, self._what())
            return self._result(failures=failures)
        if running == 0:
            self._join_output()
            return self._result(return_values=self._return_values())
        return None

    def _what(self) -> str:
        return f"binary: {self.entrypoint}"

    def _return_values(self) -> dict[int, Any]:
        """A binary has no return value: ``None`` per rank (torch's placeholder)."""
        return dict.fromkeys(range(self.nprocs))

    def _result(self, **outcome: Any) -> RunProcsResult:
        """The result with torch's log-file fields: the file of each redirected stream, else ""."""
        files = {name: {rank: (path if path not in ("", os.devnull) else "") for rank, path in paths.items()}
                 for name, paths in (("stdouts", self.stdouts), ("stderrs", self.stderrs))}
        return RunProcsResult(**outcome, **files)

    def _close(self, death_sig: signal.Signals, timeout: float = 30) -> None:
        if self._closed:
            return
        self._closed = True
        alive = [h for h in self.subprocess_handlers.values() if h.proc.poll() is None]
        for handler in alive:
            log.warning("Sending process %d closing signal %s", handler.proc.pid, signal.Signals(death_sig).name)
        for handler in self.subprocess_handlers.values():
            handler.close(death_sig)
        deadline = time.monotonic() + timeout
        for handler in alive:
            try:
                handler.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for handler in self.subprocess_handlers.values():
            if handler.proc.poll() is None:
                log.warning("Unable to shutdown process %d via %s, forcefully exiting via SIGKILL",
                            handler.proc.pid, signal.Signals(death_sig).name)
            handler.close(signal.SIGKILL)
            handler.proc.wait()
        self._join_output()

    def _join_output(self) -> None:
        for handler in self.subprocess_handlers.values():
            handler.join_output(timeout=5.0)


class SubprocessContext(_ProcessesContext):
    """Workers started as ``entrypoint *args[local_rank]`` with ``envs[local_rank]`` over this environment."""

    def __init__(self, name: str, entrypoint: str, args: dict[int, tuple], envs: dict[int, dict[str, str]],
                 logs_specs: LogsSpecs, log_line_prefixes: dict[int, str] | None = None, numa_options: Any = None,
                 duplicate_stdout_filters: list[str] | None = None,
                 duplicate_stderr_filters: list[str] | None = None) -> None:
        super().__init__(name, entrypoint, args, envs, logs_specs, log_line_prefixes, duplicate_stdout_filters,
                         duplicate_stderr_filters)


class MultiprocessContext(_ProcessesContext):
    """Workers that each call ``entrypoint(*args[local_rank])``; the return values come back by local rank."""

    def __init__(self, name: str, entrypoint: Callable, args: dict[int, tuple], envs: dict[int, dict[str, str]],
                 start_method: str, logs_specs: LogsSpecs, log_line_prefixes: dict[int, str] | None = None,
                 numa_options: Any = None, duplicate_stdout_filters: list[str] | None = None,
                 duplicate_stderr_filters: list[str] | None = None) -> None:
        if start_method not in _START_METHODS:
            raise ValueError(f"start_method must be one of {_START_METHODS}, got {start_method!r}")
        super().__init__(name, entrypoint, args, envs, logs_specs, log_line_prefixes, duplicate_stdout_filters,
                         duplicate_stderr_filters)
        self.start_method = start_method
        self._tmp = tempfile.mkdtemp(prefix="torchdist-function-")

    def _start(self) -> None:
        preparation = multiprocessing.spawn.get_preparation_data(self.name)
        preparation.pop("authkey", None)  # multiprocessing's own connections' key: not ours to send
        for rank in range(self.nprocs):
            with open(self._call_file(rank), "wb") as f:
                pickle.dump(preparation, f)
                pickle.dump((self.entrypoint, tuple(self.args[rank])), f)
        super()._start()

    def _what(self) -> str:
        return f"fn: {getattr(self.entrypoint, '__qualname__', self.entrypoint)} (start_method: {self.start_method})"

    def _call_file(self, local_rank: int) -> str:
        return os.path.join(self._tmp, f"call{local_rank}.pkl")

    def _argv(self, local_rank: int) -> tuple[str, ...]:
        return (sys.executable, "-u", "-m", "torchdist.elastic.function_worker", self._call_file(local_rank),
                self._tmp, str(local_rank))

    def _return_values(self) -> dict[int, Any]:
        values = {}
        for rank in range(self.nprocs):
            with open(os.path.join(self._tmp, f"{rank}.pkl"), "rb") as f:
                values[rank] = pickle.load(f)
        return values

    def _close(self, death_sig: signal.Signals, timeout: float = 30) -> None:
        super()._close(death_sig, timeout)
        shutil.rmtree(self._tmp, ignore_errors=True)
