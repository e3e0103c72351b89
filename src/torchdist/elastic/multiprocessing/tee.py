"""Copy a worker's output pipe to its log file and, prefixed line by line, to the console.

One :class:`StreamCopier` thread per piped stream. Lines are written whole under
one lock per console stream, so the output of two ranks never interleaves inside
a line; a partial last line (no newline before EOF) is still written. The thread
ends when the worker closes its end of the pipe (it exited, or was killed).
Echoed lines that contain one of the ``duplicate`` filters are also appended,
prefixed, to a file the ranks share: one ``write`` per line in append mode, so
lines of different ranks do not interleave there either.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import BinaryIO

__all__ = ["StreamCopier", "console_lock"]

log = logging.getLogger(__name__)

_locks: dict[int, threading.Lock] = {}
_locks_guard = threading.Lock()


def console_lock(stream: BinaryIO) -> threading.Lock:
    """The lock that serializes whole lines written to ``stream``."""
    with _locks_guard:
        return _locks.setdefault(id(stream), threading.Lock())


class StreamCopier(threading.Thread):
    """Reads ``source`` to EOF; writes raw lines to ``log_file`` and ``prefix + line`` to ``console``."""

    def __init__(self, source: BinaryIO, *, log_file: BinaryIO | None, console: BinaryIO | None,
                 prefix: bytes, name: str, duplicate: tuple[str, tuple[str, ...]] | None = None) -> None:
        super().__init__(name=name, daemon=True)
        self._source = source
        self._log_file = log_file
        self._console = console
        self._prefix = prefix
        self._lock = console_lock(console) if console is not None else None
        self._duplicate = None  # (file descriptor, filters as bytes)
        if duplicate is not None:
            path, filters = duplicate
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._duplicate = (fd, tuple(f.encode() for f in filters))

    def run(self) -> None:
        try:
            for line in iter(self._source.readline, b""):
                if self._log_file is not None:
                    self._log_file.write(line)
                    self._log_file.flush()
                if self._console is not None:
                    if not line.endswith(b"\n"):
                        line += b"\n"
                    with self._lock:
                        self._console.write(self._prefix + line)
                        self._console.flush()
                    if self._duplicate is not None and any(f in line for f in self._duplicate[1]):
                        os.write(self._duplicate[0], self._prefix + line)
        except (OSError, ValueError) as exc:  # the console or the file went away
            log.debug("%s stopped copying: %s", self.name, exc)
        finally:
            self._source.close()
            if self._log_file is not None:
                self._log_file.close()
            if self._duplicate is not None:
                os.close(self._duplicate[0])
