"""Start, watch and stop the worker processes of one node, leaving none behind.

:func:`start_processes` starts one process per local rank and returns a
:class:`SubprocessContext`; :meth:`~SubprocessContext.wait` polls it and
:meth:`~SubprocessContext.close` stops what is still running.

No orphans, by three means:

1. Each worker is the leader of its own session and process group, so stopping a
   worker signals its whole group (``killpg``): helpers it forked go too, and a
   Ctrl-C on the terminal reaches the launcher only, which forwards it (torchrun's
   behaviour).
2. On Linux each worker asks the kernel for ``SIGKILL`` when its parent dies
   (``PR_SET_PDEATHSIG``, set between ``fork`` and ``exec``), so killing the
   launcher with ``SIGKILL`` still takes its workers down. The kernel ties this to
   the *thread* that forked, so start workers from a thread that lives as long as
   the agent (the agent uses its main thread).
3. :meth:`close` sends the death signal, waits up to ``timeout`` seconds, then
   ``SIGKILL``\\s the groups and reaps every process.

Output: per stream, :class:`Std` says which streams go to files (``redirects``)
and which are also echoed to the console with a line prefix (``tee``); see
:mod:`torchdist.elastic.multiprocessing.tee`.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import BinaryIO, Mapping

from .errors import ProcessFailure
from .tee import StreamCopier

__all__ = ["Std", "to_map", "WorkerCommand", "RunProcsResult", "SubprocessContext", "start_processes"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


class Std(enum.IntFlag):
    """Which standard streams a setting applies to: ``0`` none, ``1`` out, ``2`` err, ``3`` both."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3

    @classmethod
    def from_str(cls, value: str) -> "Std | dict[int, Std]":
        """``"3"`` -> ``Std.ALL``; ``"0:1,1:2"`` -> ``{0: Std.OUT, 1: Std.ERR}`` (per local rank)."""
        value = value.strip()
        try:
            if ":" not in value:
                return cls._one(value)
            pairs = (item.split(":") for item in value.split(","))
            return {int(rank): cls._one(std) for rank, std in pairs}
        except ValueError:
            raise ValueError(
                f"{value!r} is not a valid stream setting: use 0 (none), 1 (stdout), 2 (stderr), 3 (both), "
                "or per local rank as 'local_rank:value,...' (e.g. '0:3,1:0')"
            ) from None

    @classmethod
    def _one(cls, text: str) -> "Std":
        number = int(text)
        if not 0 <= number <= 3:
            raise ValueError(text)
        return cls(number)


def to_map(value: Std | Mapping[int, Std], local_world_size: int) -> dict[int, Std]:
    """One :class:`Std` per local rank; ranks a mapping leaves out get ``Std.NONE``."""
    if isinstance(value, Std):
        return {rank: value for rank in range(local_world_size)}
    return {rank: Std(value.get(rank, Std.NONE)) for rank in range(local_world_size)}


@dataclass(frozen=True)
class WorkerCommand:
    """Everything needed to start one worker process."""

    local_rank: int
    argv: tuple[str, ...]
    env: Mapping[str, str]
    log_dir: str  # stdout.log, stderr.log and error.json of this worker
    redirect: Std = Std.NONE  # streams written to files (not echoed unless in ``tee``)
    tee: Std = Std.NONE  # streams written to files and echoed with ``prefix``
    quiet: bool = False  # local_ranks_filter excludes this rank from the console
    prefix: str = ""
    #: Per stream: echoed lines containing one of these strings are also appended
    #: (prefixed) to filtered_stdout.log / filtered_stderr.log next to the ranks' dirs.
    duplicate_filters: Mapping[Std, tuple[str, ...]] = field(default_factory=dict)

    @property
    def error_file(self) -> str:
        return os.path.join(self.log_dir, "error.json")


@dataclass
class RunProcsResult:
    """The outcome of a finished group: ``failures`` is empty on success."""

    return_values: dict[int, object] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    stdouts: dict[int, str] = field(default_factory=dict)  # by local rank: its stdout.log, "" if not redirected
    stderrs: dict[int, str] = field(default_factory=dict)

    def is_failed(self) -> bool:
        return bool(self.failures)


def _die_with_parent(parent_pid: int):
    """The ``preexec_fn`` asking the kernel to SIGKILL the worker when the launcher dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        log.warning("prctl is unavailable: workers will not die with a SIGKILLed launcher")
        return None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the launcher died before prctl took effect
            os._exit(1)

    return preexec


class _Worker:
    """One started process and the threads and files that carry its output."""

    def __init__(self, command: WorkerCommand) -> None:
        self.command = command
        os.makedirs(command.log_dir, exist_ok=True)
        self.copiers: list[StreamCopier] = []
        self.files: list[BinaryIO] = []
        stdout = self._target(Std.OUT)
        stderr = self._target(Std.ERR)
        self.proc = subprocess.Popen(
            list(command.argv),
            env=dict(command.env),
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
            preexec_fn=_die_with_parent(os.getpid()),
        )
        for file in self.files:  # the child holds its own descriptors now
            file.close()
        self.files.clear()
        for std, pipe, console in ((Std.OUT, self.proc.stdout, sys.stdout), (Std.ERR, self.proc.stderr, sys.stderr)):
            if pipe is None:
                continue
            tee = bool(self.command.tee & std) and not self.command.quiet
            log_file = open(self._log_path(std), "wb") if (self.command.tee | self.command.redirect) & std else None
            filters = self.command.duplicate_filters.get(std, ()) if tee else ()
            copier = StreamCopier(
                pipe,
                log_file=log_file,
                console=_binary(console) if tee else None,
                prefix=self.command.prefix.encode(),
                name=f"torchdist-tee-{self.command.local_rank}-{std.name.lower()}",
                duplicate=(self._filtered_path(std), filters) if filters else None,
            )
            copier.start()
            self.copiers.append(copier)

    def _log_path(self, std: Std) -> str:
        return os.path.join(self.command.log_dir, "stdout.log" if std == Std.OUT else "stderr.log")

    def log_file(self, std: Std) -> str:
        """The file ``std`` is written to, or "" if it is not (``RunProcsResult.stdouts``)."""
        return self._log_path(std) if (self.command.redirect | self.command.tee) & std else ""

    def _filtered_path(self, std: Std) -> str:
        """The attempt's file of filtered lines, shared by its ranks (torchrun's layout)."""
        name = "filtered_stdout.log" if std == Std.OUT else "filtered_stderr.log"
        return os.path.join(os.path.dirname(self.command.log_dir), name)

    def _target(self, std: Std):
        """Where the child writes ``std``: inherited, a file, a pipe (tee), or nowhere."""
        cmd = self.command
        if cmd.tee & std and not cmd.quiet:
            return subprocess.PIPE
        if (cmd.redirect | cmd.tee) & std:
            file = open(self._log_path(std), "wb")
            self.files.append(file)
            return file
        return subprocess.DEVNULL if cmd.quiet else None

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # the whole group is gone already

    def join_output(self, timeout: float) -> None:
        for copier in self.copiers:
            copier.join(timeout)


def _binary(stream) -> BinaryIO:
    return getattr(stream, "buffer", stream)


class SubprocessContext:
    """The worker processes of one node for one attempt."""

    def __init__(self, name: str, commands: list[WorkerCommand]) -> None:
        self.name = name
        self._commands = commands
        self._workers: list[_Worker] = []
        self._closed = False

    def start(self) -> None:
        for command in self._commands:
            if os.path.exists(command.error_file):
                os.remove(command.error_file)  # a stale file would pose as this attempt's error
            self._workers.append(_Worker(command))
        log.debug("started %s: pids %s", self.name, self.pids())

    def pids(self) -> dict[int, int]:
        return {w.command.local_rank: w.proc.pid for w in self._workers}

    def wait(self, timeout: float = -1, period: float = 0.1) -> RunProcsResult | None:
        """Poll until all workers succeeded or one failed; ``None`` if still running after ``timeout``.

        ``timeout < 0`` waits for ever; ``0`` polls once.
        """
        deadline = None if timeout < 0 else time.monotonic() + timeout
        while True:
            result = self._poll()
            if result is not None:
                return result
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(period)

    def _poll(self) -> RunProcsResult | None:
        failures: dict[int, ProcessFailure] = {}
        running = 0
        for worker in self._workers:
            code = worker.proc.poll()
            if code is None:
                running += 1
            elif code != 0:
                failures[worker.command.local_rank] = ProcessFailure(
                    worker.command.local_rank, worker.proc.pid, code, worker.command.error_file
                )
        if failures:
            for rank, failure in failures.items():
                log.error("failed (exitcode: %d) local_rank: %d (pid: %d) of binary: %s",
                          failure.exitcode, rank, failure.pid, self._commands[rank].argv[0])
            return RunProcsResult(failures=failures, **self._log_files())
        if running == 0:
            self._join_output()
            return RunProcsResult(return_values={w.command.local_rank: None for w in self._workers},
                                  **self._log_files())
        return None

    def _log_files(self) -> dict[str, dict[int, str]]:
        return {name: {w.command.local_rank: w.log_file(std) for w in self._workers}
                for name, std in (("stdouts", Std.OUT), ("stderrs", Std.ERR))}

    def close(self, death_sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        """Stop every worker (and the processes it forked): ``death_sig``, then SIGKILL after ``timeout``."""
        if self._closed:
            return
        self._closed = True
        alive = [w for w in self._workers if w.proc.poll() is None]
        for worker in alive:
            log.warning("Sending process %d closing signal %s", worker.proc.pid, signal.Signals(death_sig).name)
        for worker in self._workers:
            worker.signal_group(death_sig)  # exited workers too: their children may linger
        deadline = time.monotonic() + timeout
        for worker in alive:
            try:
                worker.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for worker in self._workers:
            if worker.proc.poll() is None:
                log.warning("Unable to shutdown process %d via %s, forcefully exiting via SIGKILL",
                            worker.proc.pid, signal.Signals(death_sig).name)
            worker.signal_group(signal.SIGKILL)
            worker.proc.wait()
        self._join_output()

    def _join_output(self) -> None:
        for worker in self._workers:
            worker.join_output(timeout=5.0)


def start_processes(name: str, commands: list[WorkerCommand]) -> SubprocessContext:
    """Start one process per command; the caller must ``close()`` the returned context."""
    context = SubprocessContext(name, commands)
    try:
        context.start()
    except BaseException:
        context.close(signal.SIGKILL, 0)
        raise
    return context
