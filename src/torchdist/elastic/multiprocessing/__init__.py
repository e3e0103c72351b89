"""Worker processes of one node (torch.distributed.elastic.multiprocessing): start, watch, stop, report.

Re-exports only: processes in :mod:`.api`, output copying in :mod:`.tee`,
error reporting (``@record``, ``ChildFailedError``) in :mod:`.errors`.
"""

from .api import RunProcsResult, Std, SubprocessContext, WorkerCommand, start_processes, to_map
from .errors import ChildFailedError, ErrorHandler, ProcessFailure, get_error_handler, record

__all__ = [
    "ChildFailedError",
    "ErrorHandler",
    "ProcessFailure",
    "RunProcsResult",
    "Std",
    "SubprocessContext",
    "WorkerCommand",
    "get_error_handler",
    "record",
    "start_processes",
    "to_map",
]
