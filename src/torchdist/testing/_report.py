"""What became of the ranks of a :func:`~torchdist.testing.run_ranks` call, and the report of it.

:class:`RankOutcome` records one rank's fate; :class:`RanksFailed` carries the
outcomes of a failed call and a message made for a person reading a pytest
failure: a one-line summary first, naming every failed rank and the ranks
that succeeded, then each failed rank's traceback, or, for a rank that was
killed or crashed, the stacks it dumped, tidied and with source lines, as
in a traceback.

What can become of a rank (:class:`RankStatus`)::

    RETURNED       fn returned; the result came back          (success)
    RAISED         fn, or the harness inside the rank, raised  (traceback)
    DIED           the process ended without reporting         (exit code or
                                                                signal, stacks
                                                                if it crashed)
    STILL_RUNNING  killed at the timeout, or `grace` s after
                   another rank failed                          (stacks)
    DID_NOT_EXIT   returned, but the process did not end        (stacks)
"""

from __future__ import annotations

import enum
import linecache
import multiprocessing.forkserver
import multiprocessing.process
import multiprocessing.spawn
import os
import re
import signal
from dataclasses import dataclass
from typing import Any, Sequence

from . import _worker

__all__ = ["RankOutcome", "RankStatus", "RanksFailed", "describe_exit", "format_report", "tidy_stacks"]


class RankStatus(enum.Enum):
    """What became of one rank; see the module docstring."""

    RETURNED = "returned"
    RAISED = "raised"
    DIED = "died"
    STILL_RUNNING = "still running"
    DID_NOT_EXIT = "did not exit"


@dataclass(frozen=True)
class RankOutcome:
    """The fate of one rank in a :func:`run_ranks` call."""

    rank: int
    status: RankStatus
    result: Any = None
    summary: str = ""  # one line after "rank R": "raised ValueError: boom", ...
    traceback: str = ""  # the formatted traceback, for RAISED
    stacks: str = ""  # faulthandler's dump with source lines, for the others

    @property
    def ok(self) -> bool:
        return self.status is RankStatus.RETURNED


class RanksFailed(AssertionError):
    """Some rank raised, died, hung past the timeout, or did not exit.

    The message has a one-line summary first, then, for every failed rank, its
    traceback or its stacks. ``outcomes`` holds one :class:`RankOutcome` per
    rank, in rank order. An AssertionError, so that pytest reports a failure of
    the code under test rather than an error of the test.
    """

    def __init__(self, message: str, outcomes: Sequence[RankOutcome] = ()) -> None:
        super().__init__(message)
        self.outcomes: tuple[RankOutcome, ...] = tuple(outcomes)

    @property
    def failed_ranks(self) -> list[int]:
        return [o.rank for o in self.outcomes if not o.ok]


def describe_exit(exitcode: int | None) -> str:
    """``"exited with code 3"`` or ``"killed by signal SIGSEGV (11)"``, from multiprocessing's exitcode."""
    if exitcode is None:
        return "exit status unknown"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {name} ({-exitcode})"
    return f"exited with code {exitcode}"


_FRAME_LINE = re.compile(
    r'^(?P<indent>\s*)File "(?P<path>[^"]+)", line (?P<lineno>\d+) in (?P<function>\S+)'
)
# The outermost frames of every rank: the fork server, multiprocessing's
# bootstrap and the worker module. Cut from dumps, they would only bury fn.
_OWN_FILES = frozenset(
    {
        os.path.abspath(_worker.__file__),
        os.path.abspath(multiprocessing.process.__file__),
        os.path.abspath(multiprocessing.spawn.__file__),
        os.path.abspath(multiprocessing.forkserver.__file__),
        "<string>",
    }
)


def tidy_stacks(dump: str) -> str:
    """faulthandler's dump made readable, as in a traceback.

    Drops the harness's own watchdog thread, the harness's outermost frames
    of each thread and the list of extension modules; adds each frame's
    source line below it.
    """
    blocks = [block.splitlines() for block in re.split(r"\n\s*\n", dump.strip()) if block.strip()]
    out: list[str] = []
    for block in blocks:
        if block[0].startswith("Extension modules:"):
            continue
        frames = [(line, _FRAME_LINE.match(line)) for line in block]
        if any(m and m["function"] == _worker.watch_parent.__name__ for _, m in frames):
            continue
        while len(frames) > 1 and frames[-1][1] and frames[-1][1]["path"] in _OWN_FILES:
            frames.pop()
        if out:
            out.append("")
        for line, match in frames:
            out.append(line)
            if match:
                source = linecache.getline(match["path"], int(match["lineno"])).strip()
                if source:
                    out.append(f"{match['indent']}    {source}")
    return "\n".join(out)


def format_report(label: str, outcomes: list[RankOutcome]) -> str:
    """The message of :class:`RanksFailed`: a summary line, then every failed rank."""
    failed = [o for o in outcomes if not o.ok]
    succeeded = [o.rank for o in outcomes if o.ok]
    lines = [
        f"{label}: "
        + "; ".join(f"rank {o.rank} {o.summary}" for o in failed)
        + f" (ranks that succeeded: {succeeded or 'none'})"
    ]
    for o in failed:
        lines.append("")
        if o.traceback:
            lines.append(f"--- rank {o.rank} {o.summary} ---")
            lines.append(o.traceback.rstrip())
        elif o.stacks:
            lines.append(f"--- rank {o.rank} {o.summary}; its stacks, most recent call first ---")
            lines.append(o.stacks)
        else:
            lines.append(
                f"--- rank {o.rank} {o.summary}; no traceback or stacks were recorded; "
                "its stderr (captured output) may say more ---"
            )
    return "\n".join(lines)
