"""Where each worker's output and error file go: :class:`LogsSpecs` turns settings into a :class:`LogsDest`.

:class:`DefaultLogsSpecs` lays files out as torchrun does::

    <log_dir>/<run_id>_<random>/attempt_<restart>/<local_rank>/{stdout.log,stderr.log,error.json}
    <log_dir>/<run_id>_<random>/attempt_<restart>/filtered_{stdout,stderr}.log

In a :class:`LogsDest` a stream's path is ``""`` for "the console" and
``os.devnull`` for "nowhere" (a rank that ``local_ranks_filter`` leaves out); a
teed stream is written to its file *and* echoed to the console.
"""

from __future__ import annotations

import abc
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Mapping

from ._std import Std, to_map
from .errors import ERROR_FILE_ENV

__all__ = ["LogsDest", "LogsSpecs", "DefaultLogsSpecs"]

log = logging.getLogger(__name__)

_CONSOLE = ""


@dataclass
class LogsDest:
    """Per local rank, the file of each stream ("" = console) and of the error record."""

    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)
    tee_stdouts: dict[int, str] = field(default_factory=dict)
    tee_stderrs: dict[int, str] = field(default_factory=dict)
    error_files: dict[int, str] = field(default_factory=dict)
    filtered_stdout: str = ""
    filtered_stderr: str = ""


class LogsSpecs(abc.ABC):
    """Settings for the workers' output: a root ``log_dir``, ``redirects`` and ``tee`` per local rank."""

    def __init__(self, log_dir: str | None = None, redirects: Std | Mapping[int, Std] = Std.NONE,
                 tee: Std | Mapping[int, Std] = Std.NONE, local_ranks_filter: set[int] | None = None) -> None:
        self._root_log_dir = log_dir
        self._redirects = redirects
        self._tee = tee
        self._local_ranks_filter = local_ranks_filter

    @abc.abstractmethod
    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """The destinations for one attempt; also sets each rank's ``TORCHELASTIC_ERROR_FILE`` in ``envs``."""

    @property
    @abc.abstractmethod
    def root_log_dir(self) -> str: ...


class DefaultLogsSpecs(LogsSpecs):
    """torchrun's layout (module docstring); without ``log_dir`` a fresh temporary directory is the root."""

    def __init__(self, log_dir: str | None = None, redirects: Std | Mapping[int, Std] = Std.NONE,
                 tee: Std | Mapping[int, Std] = Std.NONE, local_ranks_filter: set[int] | None = None) -> None:
        #: True when this object made the root itself (the launcher removes it after a successful run).
        self.owns_root = False
        if log_dir != os.devnull:
            if not log_dir:
                log_dir = tempfile.mkdtemp(prefix="torchelastic_")
                self.owns_root = True
            elif os.path.isfile(log_dir):
                raise NotADirectoryError(f"log_dir: {log_dir} is a file")
            else:
                os.makedirs(log_dir, exist_ok=True)
        super().__init__(log_dir, redirects, tee, local_ranks_filter)
        self._run_log_dir: str | None = None  # made on the first reify, shared by every attempt

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        nprocs = len(envs)
        first = envs[0] if nprocs else {}
        if self._root_log_dir == os.devnull:
            return self._devnull_dest(envs)
        if self._run_log_dir is None:
            run_id = first.get("TORCHELASTIC_RUN_ID", "test_run_id")
            self._run_log_dir = tempfile.mkdtemp(prefix=f"{run_id}_", dir=self._root_log_dir)
            log.info("log directory set to: %s", self._run_log_dir)
        attempt_dir = os.path.join(self._run_log_dir, f"attempt_{first.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        shutil.rmtree(attempt_dir, ignore_errors=True)  # a stale error.json would pose as this attempt's
        os.makedirs(attempt_dir)
        dest = LogsDest(filtered_stdout=os.path.join(attempt_dir, "filtered_stdout.log"),
                        filtered_stderr=os.path.join(attempt_dir, "filtered_stderr.log"))
        redirects, tees = to_map(self._redirects, nprocs), to_map(self._tee, nprocs)
        for rank in range(nprocs):
            rank_dir = os.path.join(attempt_dir, str(rank))
            os.mkdir(rank_dir)
            self._place_rank(dest, rank, rank_dir, redirects[rank] | tees[rank], tees[rank])
            envs[rank][ERROR_FILE_ENV] = dest.error_files[rank]
        return dest

    def _place_rank(self, dest: LogsDest, rank: int, rank_dir: str, files: Std, tee: Std) -> None:
        """Fill ``dest`` for one rank: a teed stream is also a file; a filtered-out rank shows nothing."""
        shown = not self._local_ranks_filter or rank in self._local_ranks_filter
        for std, paths, tee_paths, name in ((Std.OUT, dest.stdouts, dest.tee_stdouts, "stdout.log"),
                                            (Std.ERR, dest.stderrs, dest.tee_stderrs, "stderr.log")):
            paths[rank] = os.path.join(rank_dir, name) if files & std else (_CONSOLE if shown else os.devnull)
            if tee & std and shown:
                tee_paths[rank] = paths[rank]
        dest.error_files[rank] = os.path.join(rank_dir, "error.json")

    @staticmethod
    def _devnull_dest(envs: dict[int, dict[str, str]]) -> LogsDest:
        ranks = range(len(envs))
        for rank in ranks:
            envs[rank][ERROR_FILE_ENV] = ""
        # torch tails os.devnull here: nothing is echoed, so no rank is teed.
        return LogsDest(dict.fromkeys(ranks, _CONSOLE), dict.fromkeys(ranks, _CONSOLE), {}, {},
                        dict.fromkeys(ranks, os.devnull), os.devnull, os.devnull)

    def __repr__(self) -> str:
        return (f"DefaultLogsSpecs(root_log_dir={self._root_log_dir}, redirects={self._redirects}, "
                f"tee={self._tee}, local_ranks_filter={self._local_ranks_filter})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DefaultLogsSpecs):
            return False
        return (self._root_log_dir, self._redirects, self._tee, self._local_ranks_filter) == (
            other._root_log_dir, other._redirects, other._tee, other._local_ranks_filter)
