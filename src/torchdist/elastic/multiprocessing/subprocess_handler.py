"""One worker process and the threads and files that carry its output (torch's ``SubprocessHandler``).

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
3. :meth:`PContext.close` sends the death signal, waits, then ``SIGKILL``\\s the
   groups and reaps every process.

Output: a stream goes to the console (path ``""``), to a file, or nowhere
(``os.devnull``); a teed stream goes through a pipe that a
:class:`~.tee.StreamCopier` copies to its file and, prefixed, to the console.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
from typing import BinaryIO, Mapping

from .tee import StreamCopier

__all__ = ["SubprocessHandler"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int):
    """The ``preexec_fn`` asking the kernel to SIGKILL the worker when the launcher dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        log.warning("prctl is unavailable: workers will not die with a SIGKILLed launcher")
        return None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the launcher died before prctl took effect
            os._exit(1)

    return preexec


class SubprocessHandler:
    """Starts ``argv`` with ``env`` (over this process's environment) and carries its output.

    ``stdout``/``stderr``: "" (console), a file path, or ``os.devnull``; ``tee_*``:
    echo that file's stream to the console too, each line prefixed with ``prefix``;
    ``duplicate``: per stream ``(file, filters)``, echoed lines that contain a filter
    are also appended there (the attempt's ``filtered_*.log``).
    """

    def __init__(self, local_rank: int, argv: tuple[str, ...], env: Mapping[str, str], *, stdout: str = "",
                 stderr: str = "", tee_stdout: bool = False, tee_stderr: bool = False, prefix: str = "",
                 duplicate: Mapping[str, tuple[str, tuple[str, ...]]] | None = None) -> None:
        self.local_rank = local_rank
        self.copiers: list[StreamCopier] = []
        full_env = dict(os.environ)
        full_env.update(env)
        streams = {"out": (stdout, tee_stdout, sys.stdout), "err": (stderr, tee_stderr, sys.stderr)}
        opened: list[BinaryIO] = []
        targets = {name: self._target(path, tee, opened) for name, (path, tee, _) in streams.items()}
        try:
            self.proc = subprocess.Popen(list(argv), env=full_env, stdout=targets["out"], stderr=targets["err"],
                                         start_new_session=True, preexec_fn=_die_with_parent(os.getpid()))
        finally:
            for file in opened:  # the child holds its own descriptors now
                file.close()
        for name, (path, tee, console) in streams.items():
            pipe = self.proc.stdout if name == "out" else self.proc.stderr
            if pipe is not None:
                self._copy(pipe, path, console, prefix, (duplicate or {}).get(name), name)

    @staticmethod
    def _target(path: str, tee: bool, opened: list[BinaryIO]):
        """Where the child writes one stream: a pipe (tee), inherited (console), or a file."""
        if tee:
            return subprocess.PIPE
        if not path:
            return None
        file = open(path, "wb")
        opened.append(file)
        return file

    def _copy(self, pipe: BinaryIO, path: str, console, prefix: str,
              duplicate: tuple[str, tuple[str, ...]] | None, name: str) -> None:
        copier = StreamCopier(pipe, log_file=open(path, "wb") if path else None, console=_binary(console),
                              prefix=prefix.encode(), name=f"torchdist-tee-{self.local_rank}-std{name}",
                              duplicate=duplicate if duplicate and duplicate[1] else None)
        copier.start()
        self.copiers.append(copier)

    def close(self, death_sig: int) -> None:
        """Signal the worker's whole process group (exited workers too: their children may linger)."""
        try:
            os.killpg(self.proc.pid, death_sig)
        except (ProcessLookupError, PermissionError):
            pass  # the whole group is gone already

    def join_output(self, timeout: float) -> None:
        for copier in self.copiers:
            copier.join(timeout)


def _binary(stream) -> BinaryIO:
    return getattr(stream, "buffer", stream)
