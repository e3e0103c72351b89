"""Worker error reporting: ``@record`` in the worker, ``ChildFailedError`` in the launcher.

The path of one failure, end to end::

    worker: @record main() raises  -->  JSON written to $TORCHELASTIC_ERROR_FILE, exception re-raised
    agent:  the worker exits non-zero  -->  ProcessFailure(local_rank, pid, exitcode, error_file)
                                            reads the JSON (message, traceback, timestamp) if any
    launcher: ChildFailedError(name, {rank: ProcessFailure})  -->  the summary below, exit code 1

The error file holds torchrun's format, so tools that read one read the other::

    {"message": {"message": "ValueError: boom",
                 "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1700000000"}}}

The *root cause* is the failure with the earliest timestamp (the first observed),
as in torchrun; a worker the agent stopped itself is not a failure.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import socket
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, TypeVar

__all__ = ["record", "ErrorHandler", "get_error_handler", "ProcessFailure", "ChildFailedError", "ERROR_FILE_ENV"]

log = logging.getLogger(__name__)

#: Where a worker writes its error record; set by the agent for every worker.
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
_NA = "<N/A>"
_NO_TRACEBACK = (
    "To enable traceback, decorate the worker's main function with "
    "@torchdist.elastic.multiprocessing.errors.record (see docs/launcher.md)"
)

F = TypeVar("F", bound=Callable[..., Any])


class ErrorHandler:
    """Writes the exception of a worker to ``$TORCHELASTIC_ERROR_FILE`` (torchrun's JSON format)."""

    def initialize(self) -> None:
        """Make fatal signals dump a Python traceback to stderr (faulthandler)."""
        try:
            import faulthandler

            faulthandler.enable(all_threads=True)
        except Exception as exc:  # noqa: BLE001 - best effort, stderr may be closed
            log.debug("faulthandler not enabled: %s", exc)

    def error_file(self) -> str | None:
        return os.environ.get(ERROR_FILE_ENV)

    def record_exception(self, exc: BaseException) -> None:
        """Write ``exc`` and the current traceback; log it instead when no file is configured."""
        data = {
            "message": {
                "message": f"{type(exc).__name__}: {exc}",
                "extraInfo": {
                    "py_callstack": "".join(traceback.format_exception(exc)),
                    "timestamp": str(int(time.time())),
                },
            }
        }
        if not self.error_file():
            log.debug("%s is not set; not writing an error file for %r", ERROR_FILE_ENV, exc)
            return
        self._write(data)

    def dump_error_file(self, failure: "ProcessFailure") -> None:
        """A launcher's own error file: its root-cause worker's record, with the exit code
        (a worker killed by a signal could not write it), for whoever launched the launcher."""
        if not self.error_file() or not failure.has_error_file():
            return
        data = json.loads(json.dumps(failure.error_file_data))  # a copy
        if failure.exitcode and isinstance(data.get("message"), dict):
            data["message"]["errorCode"] = failure.exitcode
        self._write(data)

    def _write(self, data: dict) -> None:
        path = self.error_file()
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as fp:
                json.dump(data, fp)
        except OSError as write_error:
            log.warning("could not write the error file %s: %s", path, write_error)


def get_error_handler() -> ErrorHandler:
    return ErrorHandler()


def record(fn: F | None = None, error_handler: ErrorHandler | None = None) -> F:
    """Decorate a worker's main function: an uncaught exception is written to the error file, then re-raised.

    As torchrun's: ``SystemExit`` is not an error here (a non-zero exit is reported
    through its exit code, and ``sys.exit(0)`` returns None from the decorated
    function); a :class:`ChildFailedError` (a launcher's) copies the root-cause
    worker's error file to this process's own.
    """
    handler = error_handler or get_error_handler()

    def wrap(f: F) -> F:
        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            handler.initialize()
            try:
                return f(*args, **kwargs)
            except SystemExit as exc:
                if exc.code == 0:  # (as torchrun's: a bare sys.exit() is re-raised)
                    return None
                raise
            except ChildFailedError as exc:
                handler.dump_error_file(exc.get_first_failure()[1])
                raise
            except Exception as exc:  # not KeyboardInterrupt: the summary reports the signal, as torchrun's
                handler.record_exception(exc)
                raise

        return wrapper  # type: ignore[return-value]

    if fn is None:
        return wrap  # type: ignore[return-value]
    return wrap(fn)


@dataclass
class ProcessFailure:
    """One worker that exited non-zero: what the launcher's summary shows about it.

    As torch's, ``message`` is the error file's ``"message"`` entry (a dict with
    ``extraInfo.py_callstack`` for ``@record``'s files), else a sentence; :meth:`text`
    is the traceback text either way.
    """

    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    error_file_data: dict = field(init=False, default_factory=dict)
    message: Any = field(init=False, default="")
    timestamp: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.timestamp = int(time.time())
        if self.error_file and os.path.isfile(self.error_file):
            try:
                with open(self.error_file) as fp:
                    self.error_file_data = json.load(fp)
                record_ = self.error_file_data["message"]
                if not isinstance(record_, str):
                    self.timestamp = int(record_["extraInfo"]["timestamp"])
                self.message = record_
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("cannot read the error file %s of local rank %d: %s", self.error_file, self.local_rank, exc)
                self.error_file_data = {}
        if not self.message:
            if self.exitcode < 0:
                self.message = f"Signal {-self.exitcode} ({self.signal_name()}) received by PID {self.pid}"
            else:
                self.message = _NO_TRACEBACK

    def text(self) -> str:
        """The traceback (or the sentence) of this failure, as the summary shows it."""
        if isinstance(self.message, dict):
            return str(self.message.get("extraInfo", {}).get("py_callstack", self.message.get("message", _NA)))
        return str(self.message)

    def signal_name(self) -> str:
        if self.exitcode < 0:
            try:
                return signal.Signals(-self.exitcode).name
            except ValueError:
                return _NA
        return _NA

    def timestamp_isoformat(self) -> str:
        return datetime.fromtimestamp(self.timestamp).isoformat(sep="_", timespec="seconds")

    def has_error_file(self) -> bool:
        return bool(self.error_file_data)

    def to_dict(self) -> dict:
        """What another node needs to show this failure in its own summary."""
        return {"local_rank": self.local_rank, "pid": self.pid, "exitcode": self.exitcode,
                "error_file": self.error_file if self.has_error_file() else "", "message": self.text(),
                "timestamp": self.timestamp}

    @classmethod
    def from_dict(cls, data: dict) -> "ProcessFailure":
        """Rebuild a failure reported by another node (its error file is not readable here)."""
        failure = cls(int(data["local_rank"]), int(data["pid"]), int(data["exitcode"]), "")
        failure.message = str(data["message"])
        failure.timestamp = int(data["timestamp"])
        if data.get("error_file"):
            failure.error_file = str(data["error_file"])
            failure.error_file_data = {"remote": True}
        return failure


class ChildFailedError(Exception):
    """Raised by the launcher when workers failed; ``str()`` is the summary torchrun prints.

    ``failures`` maps each failed worker's global rank to its :class:`ProcessFailure`.
    ``hosts`` optionally names the host of each rank (workers of other nodes).
    """

    def __init__(self, name: str, failures: dict[int, ProcessFailure], hosts: dict[int, str] | None = None,
                 note: str = "") -> None:
        if not failures:
            raise ValueError("ChildFailedError needs at least one failure")
        self.name = name
        self.failures = failures
        self.hosts = hosts or {}
        self.note = note
        super().__init__(self.format_msg())

    def get_first_failure(self) -> tuple[int, ProcessFailure]:
        rank = min(self.failures, key=lambda r: (self.failures[r].timestamp, r))
        return rank, self.failures[rank]

    def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        title = f"{self.name} FAILED"
        root_rank, root = self.get_first_failure()
        others = [self._format_failure(i, rank, f) for i, (rank, f) in
                  enumerate((r, f) for r, f in sorted(self.failures.items()) if r != root_rank)]
        others_text = "\n".join(others) if others else "  <NO_OTHER_FAILURES>"
        root_text = self._format_failure(0, root_rank, root)
        width = 60  # torchrun's box width
        parts = [
            boarder_delim * width,
            title,
            section_delim * width,
            "Failures:",
            others_text,
            section_delim * width,
            "Root Cause (first observed failure):",
            root_text,
        ]
        if self.note:
            parts += [section_delim * width, self.note]
        parts.append(boarder_delim * width)
        return "\n".join(parts)

    def _format_failure(self, idx: int, rank: int, failure: ProcessFailure) -> str:
        message = failure.text().rstrip("\n").replace("\n", "\n  ")
        exit_signal = f" ({failure.signal_name()})" if failure.exitcode < 0 else ""
        return (
            f"[{idx}]:\n"
            f"  time      : {failure.timestamp_isoformat()}\n"
            f"  host      : {self.hosts.get(rank, socket.getfqdn())}\n"
            f"  rank      : {rank} (local_rank: {failure.local_rank})\n"
            f"  exitcode  : {failure.exitcode} (pid: {failure.pid}){exit_signal}\n"
            f"  error_file: {failure.error_file if failure.has_error_file() else _NA}\n"
            f"  traceback : {message}"
        )
