"""Copy a worker's output pipe to its log file and, prefixed line by line, to the console.

One :class:`StreamCopier` thread per piped stream. Lines are written whole under
one lock per console stream, so the output of two ranks never interleaves inside
a line; a partial last line (no newline before EOF) is still written. The thread
ends when the worker closes its end of the pipe (it exited, or was killed).
"""

from __future__ import annotations

import logging
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
                 prefix: bytes, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._source = source
        self._log_file = log_file
        self._console = console
        self._prefix = prefix
        self._lock = console_lock(console) if console is not None else None

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
        except (OSError, ValueError) as exc:  # the console or the file went away
            log.debug("%s stopped copying: %s", self.name, exc)
        finally:
            self._source.close()
            if self._log_file is not None:
                self._log_file.close()
