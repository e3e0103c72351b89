"""``CheckpointException``: a save or load failed on some ranks; every rank raises it, with each failure."""

from __future__ import annotations

import traceback
from typing import Any

__all__ = ["CheckpointException"]

WRAPPED_EXCEPTION = tuple[BaseException, traceback.StackSummary]


def _wrap_exception(exc: BaseException) -> WRAPPED_EXCEPTION:
    """The exception and its stack as frames, which pickle (tracebacks do not), to send to the other ranks."""
    summary = traceback.extract_tb(exc.__traceback__)
    for frame in summary:
        if hasattr(frame, "_code"):  # code objects do not pickle
            object.__setattr__(frame, "_code", None)
    return exc, summary


def _is_wrapped_exception(obj: Any) -> bool:
    return (isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], BaseException)
            and isinstance(obj[1], traceback.StackSummary))


class CheckpointException(BaseException):
    """Raised on every rank when a step of a save or load failed on one or more ranks.

    A BaseException, as in PyTorch. ``failures`` maps each failed rank to its
    (exception, stack) pair; ``str()`` prints them all.
    """

    def __init__(self, msg: str, failures: dict[int, WRAPPED_EXCEPTION]):
        super().__init__(msg, failures)
        self._failures = failures

    @property
    def failures(self) -> dict[int, WRAPPED_EXCEPTION]:
        return self._failures

    def __str__(self) -> str:
        text = f"CheckpointException ranks:{self._failures.keys()}\n"
        for rank, (exc, stack) in self._failures.items():
            text += f"Traceback (most recent call last): (RANK {rank})\n"
            if stack is not None:
                text += "".join(traceback.format_list(stack))
            text += "".join(traceback.format_exception_only(type(exc), exc))
        return text
