"""Worker processes of one node (torch.distributed.elastic.multiprocessing): start, watch, stop, report.

:func:`start_processes` is the front; processes in :mod:`.api`, where their output
goes in :mod:`.logs_specs`, one process in :mod:`.subprocess_handler`, output
copying in :mod:`.tee`, error reporting (``@record``, ``ChildFailedError``) in :mod:`.errors`.
"""

from __future__ import annotations

from typing import Any, Callable

from .api import (
    DefaultLogsSpecs,
    LogsDest,
    LogsSpecs,
    MultiprocessContext,
    PContext,
    RunProcsResult,
    SignalException,
    Std,
    SubprocessContext,
    to_map,
)
from .errors import ChildFailedError, ErrorHandler, ProcessFailure, get_error_handler, record

__all__ = [
    "ChildFailedError",
    "DefaultLogsSpecs",
    "ErrorHandler",
    "LogsDest",
    "LogsSpecs",
    "MultiprocessContext",
    "PContext",
    "ProcessFailure",
    "RunProcsResult",
    "SignalException",
    "Std",
    "SubprocessContext",
    "get_error_handler",
    "record",
    "start_processes",
    "to_map",
]


def start_processes(name: str, entrypoint: Callable | str, args: dict[int, tuple], envs: dict[int, dict[str, str]],
                    logs_specs: LogsSpecs, log_line_prefixes: dict[int, str] | None = None,
                    start_method: str = "spawn", numa_options: Any = None,
                    duplicate_stdout_filters: list[str] | None = None,
                    duplicate_stderr_filters: list[str] | None = None) -> PContext:
    """Start one process per local rank of ``args``: ``entrypoint`` is an executable (a
    :class:`SubprocessContext`) or a function (a :class:`MultiprocessContext`). The caller
    ``wait``\\s on and ``close``\\s the returned context."""
    common = dict(name=name, entrypoint=entrypoint, args=args, envs=envs, logs_specs=logs_specs,
                  log_line_prefixes=log_line_prefixes, numa_options=numa_options,
                  duplicate_stdout_filters=duplicate_stdout_filters, duplicate_stderr_filters=duplicate_stderr_filters)
    context: PContext
    if isinstance(entrypoint, str):
        context = SubprocessContext(**common)
    else:
        context = MultiprocessContext(start_method=start_method, **common)
    try:
        context.start()
    except BaseException:
        context.close(timeout=0)
        raise
    return context
