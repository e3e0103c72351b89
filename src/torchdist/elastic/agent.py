"""The local elastic agent: one per node; it runs, watches and restarts this node's workers.

Worker states (:class:`WorkerState`) of this node's worker group, and what moves them::

                 rendezvous formed, processes started
    INIT ------------------------------------------------> HEALTHY
    HEALTHY --every worker exited 0-------------------> SUCCEEDED --exit barrier--> (done)
    HEALTHY --a worker exited non-zero----------------> FAILED
    FAILED  --restarts left: ask every node to restart-> STOPPED --> INIT (TORCHELASTIC_RESTART_COUNT + 1)
    FAILED  --no restarts left: report to every node--> (the job fails; ChildFailedError summary)
    HEALTHY --another node's workers failed-----------> STOPPED --> INIT (no restart used here, as in torchrun)
    HEALTHY --another node reported the job failed----> STOPPED --> (the job fails, naming that node's rank)
    HEALTHY --a node joined (and there is room), or a
              participant left / stopped its heartbeat-> STOPPED --> INIT (membership change: no restart used)
    HEALTHY --the rendezvous store is lost------------> UNHEALTHY --> STOPPED --> (the job fails)
    any     --SIGTERM/SIGINT/... to the launcher------> STOPPED (workers get that signal) --> (exit)

STOPPED always means: every worker process of this node got ``SIGTERM`` (or the
signal the launcher received), then ``SIGKILL`` after ``shutdown_timeout`` seconds,
and was reaped. Stopping on one node reaches the others through the rendezvous
(``restart``/``failed`` keys, heartbeats), so a failure anywhere stops the whole
worker group everywhere. Restart counts are per node, as in torchrun: a node that
joins late starts at 0.
"""

from __future__ import annotations

import enum
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from string import Template
from types import FrameType
from typing import Any, Mapping

from .multiprocessing.api import Std, SubprocessContext, WorkerCommand, start_processes, to_map
from .multiprocessing.errors import ERROR_FILE_ENV, ProcessFailure
from .rendezvous.api import RendezvousClosedError, RendezvousConnectionError, RendezvousHandler, RendezvousInfo

__all__ = ["WorkerState", "WorkerSpec", "Worker", "WorkerGroup", "RunResult", "SignalException", "LocalElasticAgent"]

log = logging.getLogger(__name__)

DEFAULT_LOG_LINE_PREFIX_TEMPLATE = "[${role_name}${local_rank}]:"


class WorkerState(str, enum.Enum):
    """The state of this node's worker group; see the module docstring for the transitions."""

    UNKNOWN = "UNKNOWN"
    INIT = "INIT"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    @staticmethod
    def is_running(state: "WorkerState") -> bool:
        return state in (WorkerState.HEALTHY, WorkerState.UNHEALTHY)


class SignalException(Exception):
    """The launcher received ``sigval``; its workers were stopped with the same signal."""

    def __init__(self, msg: str, sigval: signal.Signals) -> None:
        super().__init__(msg)
        self.sigval = sigval


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """What every worker of this node runs: ``entrypoint`` (an executable) with ``args``."""

    role: str
    local_world_size: int
    rdzv_handler: RendezvousHandler
    entrypoint: str
    args: tuple[str, ...] = ()
    max_restarts: int = 3
    monitor_interval: float = 0.1
    local_addr: str | None = None

    def __post_init__(self) -> None:
        if self.local_world_size < 1:
            raise ValueError(f"local_world_size must be >= 1, got {self.local_world_size}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not self.monitor_interval > 0:
            raise ValueError(f"monitor_interval must be > 0, got {self.monitor_interval}")
        if not isinstance(self.entrypoint, str) or not self.entrypoint:
            raise TypeError(f"entrypoint must be the path or name of an executable, got {self.entrypoint!r}")

    def get_entrypoint_name(self) -> str:
        return os.path.basename(self.entrypoint)


@dataclass
class Worker:
    """One worker process of this node, with its ranks in the current round."""

    local_rank: int
    global_rank: int
    role_rank: int
    world_size: int
    role_world_size: int
    id: int | None = None  # the pid once started


@dataclass
class WorkerGroup:
    """This node's workers in one round."""

    spec: WorkerSpec
    workers: list[Worker] = field(default_factory=list)
    rendezvous: RendezvousInfo | None = None
    state: WorkerState = WorkerState.INIT

    @property
    def group_rank(self) -> int | None:
        return None if self.rendezvous is None else self.rendezvous.group_rank


@dataclass
class RunResult:
    """How the run ended: failures are keyed by global rank; ``hosts`` names each rank's host."""

    state: WorkerState
    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    hosts: dict[int, str] = field(default_factory=dict)
    note: str = ""

    def is_failed(self) -> bool:
        return self.state == WorkerState.FAILED


class LocalElasticAgent:
    """Runs ``spec`` on this node until it succeeds, fails for good, or the launcher is signalled."""

    def __init__(self, spec: WorkerSpec, *, run_id: str, log_dir: str | None = None,
                 redirects: Std | Mapping[int, Std] = Std.NONE, tee: Std | Mapping[int, Std] = Std.NONE,
                 local_ranks_filter: frozenset[int] | None = None, log_line_prefix_template: str | None = None,
                 extra_env: Mapping[str, str] | None = None, shutdown_timeout: float = 30.0,
                 exit_barrier_timeout: float = 300.0,
                 signals_to_handle: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
                                                       signal.SIGQUIT),
                 duplicate_filters: Mapping[Std, tuple[str, ...]] | None = None,
                 virtual_local_rank: bool = False) -> None:
        self._spec = spec
        self._rdzv = spec.rdzv_handler
        self._run_id = run_id
        self._group = WorkerGroup(spec)
        self._remaining_restarts = spec.max_restarts
        self._redirects = to_map(redirects, spec.local_world_size)
        self._tee = to_map(tee, spec.local_world_size)
        self._filter = local_ranks_filter
        self._prefix_template = log_line_prefix_template or DEFAULT_LOG_LINE_PREFIX_TEMPLATE
        self._extra_env = dict(extra_env or {})
        self._shutdown_timeout = shutdown_timeout
        self._exit_barrier_timeout = exit_barrier_timeout
        self._signals = signals_to_handle
        self._duplicate_filters = {std: tuple(f) for std, f in (duplicate_filters or {}).items() if f}
        self._virtual_local_rank = virtual_local_rank
        # Without --log-dir, logs and error files go to a temp dir, removed after a successful run.
        self._own_root = None if log_dir else tempfile.mkdtemp(prefix="torchelastic_")
        root = log_dir or self._own_root
        self._log_dir = tempfile.mkdtemp(prefix=f"{run_id}_", dir=_makedirs(root))
        self._pcontext: SubprocessContext | None = None
        self._start_failure: RunResult | None = None  # the workers of this round could not be started
        self._host = spec.local_addr or socket.getfqdn()
        self._multi_node = True  # refined once the first round is known
        self._signalled = False

    @property
    def log_dir(self) -> str:
        return self._log_dir

    @property
    def restart_count(self) -> int:
        return self._spec.max_restarts - self._remaining_restarts

    def get_worker_group(self) -> WorkerGroup:
        return self._group

    # -- the run ---------------------------------------------------------------------
    def run(self) -> RunResult:
        """Run to the end; stops every worker on any way out (return, error, signal)."""
        previous = self._install_signal_handlers()
        try:
            result = self._invoke_run()
            if self._own_root is not None and result.state == WorkerState.SUCCEEDED:
                shutil.rmtree(self._own_root, ignore_errors=True)
            return result
        except SignalException as exc:
            log.warning("Received %s death signal, shutting down workers", exc.sigval.name)
            self._stop_workers(exc.sigval)
            raise
        except RendezvousConnectionError:
            self._group.state = WorkerState.UNHEALTHY
            log.error("[%s] lost the rendezvous store; stopping the workers", self._spec.role)
            raise
        finally:
            self._stop_workers(signal.SIGTERM)
            self._rdzv.shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _invoke_run(self) -> RunResult:
        try:
            self._initialize_workers()
        except RendezvousClosedError as exc:
            return self._closed_result(exc)
        while True:
            time.sleep(self._spec.monitor_interval)
            result = self._monitor_workers()
            self._group.state = result.state
            if result.state == WorkerState.SUCCEEDED:
                log.info("[%s] worker group successfully finished; waiting for the other nodes", self._spec.role)
                self._rdzv.exit_barrier(self._exit_barrier_timeout)
                return result
            if result.state == WorkerState.FAILED:
                if self._remaining_restarts > 0:
                    self._remaining_restarts -= 1
                    log.info("[%s] worker group failed; %d/%d attempts left, restarting", self._spec.role,
                             self._remaining_restarts, self._spec.max_restarts)
                    self._rdzv.request_restart(f"workers failed on {self._host}")
                    if not self._restart_workers():
                        return self._closed_after_restart()
                    continue
                self._stop_workers(signal.SIGTERM)
                self._rdzv.report_failure(self._failure_summary(result))
                return result
            reason = self._membership_change()
            if isinstance(reason, RunResult):
                return reason
            if reason:
                log.info("[%s] %s: restarting the worker group in a new round", self._spec.role, reason)
                if not self._restart_workers():
                    return self._closed_after_restart()

    def _membership_change(self) -> str | RunResult | None:
        """A reason to restart decided by another node (or a change of membership), if any."""
        if not self._multi_node:
            return None
        failed = self._rdzv.job_failure()
        if failed is not None:
            self._stop_workers(signal.SIGTERM)
            return self._remote_failure_result(failed)
        request = self._rdzv.restart_request()
        if request is not None:  # only the failing node spends one of its restarts (torchrun's count)
            return f"node {request['node']} asked for a restart ({request['reason']})"
        waiting = self._rdzv.num_nodes_waiting()
        if waiting:
            self._rdzv.request_restart(f"{waiting} node(s) waiting to join")
            return f"{waiting} node(s) waiting to join"
        lost = self._rdzv.lost_nodes()
        if lost:
            self._rdzv.request_restart(f"node(s) {', '.join(lost)} left")
            return f"node(s) {', '.join(lost)} left or stopped sending heartbeats"
        return None

    # -- rendezvous and workers ------------------------------------------------------
    def _initialize_workers(self) -> None:
        self._group.state = WorkerState.INIT
        spec = self._spec
        info = self._rdzv.next_rendezvous(spec.local_world_size)
        self._multi_node = info.group_world_size > 1 or self._rdzv_may_grow()
        offset = info.rank_offset
        workers = [
            Worker(local_rank=i, global_rank=offset + i, role_rank=offset + i, world_size=info.world_size,
                   role_world_size=info.world_size)
            for i in range(spec.local_world_size)
        ]
        self._group.workers, self._group.rendezvous = workers, info
        log.info("[%s] Rendezvous complete for workers. Result:\n  restart_count=%d\n  master_addr=%s\n"
                 "  master_port=%d\n  group_rank=%d\n  group_world_size=%d\n  local_ranks=%s\n  global_ranks=%s",
                 spec.role, self.restart_count, info.master_addr, info.master_port, info.group_rank,
                 info.group_world_size, [w.local_rank for w in workers], [w.global_rank for w in workers])
        attempt_dir = os.path.join(self._log_dir, f"attempt_{self.restart_count}")
        commands = [self._command(w, info, os.path.join(attempt_dir, str(w.local_rank))) for w in workers]
        self._start_failure = None
        try:
            self._pcontext = start_processes(f"{spec.role} attempt {self.restart_count}", commands)
        except OSError as exc:  # e.g. --no-python with a missing executable: every worker fails as a shell would
            log.error("[%s] cannot start %s: %s", spec.role, spec.entrypoint, exc)
            failures = {}
            for worker in workers:
                failure = ProcessFailure(worker.local_rank, -1, 127, "")
                failure.message = f"cannot start {spec.entrypoint!r}: {exc}"
                failures[worker.global_rank] = failure
            self._start_failure = RunResult(WorkerState.FAILED, failures=failures,
                                            hosts={r: self._host for r in failures})
            return
        for worker, pid in zip(workers, self._pcontext.pids().values()):
            worker.id = pid
        self._group.state = WorkerState.HEALTHY

    def _rdzv_may_grow(self) -> bool:
        return self._rdzv.max_nodes > 1

    def _command(self, worker: Worker, info: RendezvousInfo, log_dir: str) -> WorkerCommand:
        spec = self._spec
        env = dict(os.environ)
        env.update({
            "LOCAL_RANK": "0" if self._virtual_local_rank else str(worker.local_rank),
            "RANK": str(worker.global_rank),
            "GROUP_RANK": str(info.group_rank),
            "ROLE_RANK": str(worker.role_rank),
            "ROLE_NAME": spec.role,
            "LOCAL_WORLD_SIZE": str(spec.local_world_size),
            "WORLD_SIZE": str(worker.world_size),
            "GROUP_WORLD_SIZE": str(info.group_world_size),
            "ROLE_WORLD_SIZE": str(worker.role_world_size),
            "MASTER_ADDR": info.master_addr,
            "MASTER_PORT": str(info.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(self.restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "TORCHELASTIC_RUN_ID": self._run_id,
            "TORCHELASTIC_USE_AGENT_STORE": str(self._rdzv.use_agent_store),
            "TORCHELASTIC_SIGNALS_TO_HANDLE": ",".join(signal.Signals(s).name for s in self._signals),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            ERROR_FILE_ENV: os.path.join(log_dir, "error.json"),
        })
        env.update(self._extra_env)
        args = tuple(a.replace("${local_rank}", str(worker.local_rank)) for a in spec.args)
        prefix = Template(self._prefix_template).safe_substitute(
            role_name=spec.role, rank=worker.global_rank, local_rank=worker.local_rank)
        quiet = self._filter is not None and worker.local_rank not in self._filter
        return WorkerCommand(local_rank=worker.local_rank, argv=(spec.entrypoint, *args), env=env, log_dir=log_dir,
                             redirect=self._redirects[worker.local_rank], tee=self._tee[worker.local_rank],
                             quiet=quiet, prefix=prefix, duplicate_filters=self._duplicate_filters)

    def _monitor_workers(self) -> RunResult:
        if self._start_failure is not None:
            return self._start_failure
        assert self._pcontext is not None, "monitor before start"
        result = self._pcontext.wait(0)
        if result is None:
            return RunResult(WorkerState.HEALTHY)
        offset = self._group.rendezvous.rank_offset
        if result.is_failed():
            failures = {offset + local: f for local, f in result.failures.items()}
            return RunResult(WorkerState.FAILED, failures=failures, hosts={r: self._host for r in failures})
        return RunResult(WorkerState.SUCCEEDED,
                         return_values={offset + local: v for local, v in result.return_values.items()})

    def _restart_workers(self) -> bool:
        """Stop, re-rendezvous, start; False if the job was closed meanwhile."""
        self._stop_workers(signal.SIGTERM)
        try:
            self._initialize_workers()
        except RendezvousClosedError:
            return False
        return True

    def _stop_workers(self, sig: int) -> None:
        if self._pcontext is not None:
            self._pcontext.close(sig, self._shutdown_timeout)
            self._pcontext = None
            self._group.state = WorkerState.STOPPED

    # -- results ---------------------------------------------------------------------
    def _failure_summary(self, result: RunResult) -> dict:
        return {"node": getattr(self._rdzv, "node_id", self._host), "host": self._host,
                "failures": {str(rank): f.to_dict() for rank, f in result.failures.items()}}

    def _remote_failure_result(self, summary: dict) -> RunResult:
        failures = {int(rank): ProcessFailure.from_dict(data) for rank, data in summary["failures"].items()}
        return RunResult(WorkerState.FAILED, failures=failures, hosts={r: summary["host"] for r in failures},
                         note=f"The job failed on node {summary['node']} ({summary['host']}); this node's workers "
                              "were stopped.")

    def _closed_result(self, exc: RendezvousClosedError) -> RunResult:
        failed = self._rdzv.job_failure()
        if failed is not None:
            return self._remote_failure_result(failed)
        log.warning("%s; this node has nothing to do", exc)
        return RunResult(WorkerState.SUCCEEDED, note=str(exc))

    def _closed_after_restart(self) -> RunResult:
        return self._closed_result(RendezvousClosedError("the rendezvous was closed while this node restarted"))

    # -- signals ---------------------------------------------------------------------
    def _install_signal_handlers(self) -> dict[int, Any]:
        previous: dict[int, Any] = {}
        if sys.platform == "win32":
            return previous
        import threading

        if threading.current_thread() is not threading.main_thread():
            log.warning("the agent runs outside the main thread: signals are not forwarded to workers")
            return previous
        for sig in self._signals:
            previous[sig] = signal.signal(sig, self._on_signal)
        return previous

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """The first signal interrupts the run; later ones must not interrupt stopping the workers."""
        if self._signalled:
            log.warning("received %s while shutting down; still stopping workers", signal.Signals(signum).name)
            return
        self._signalled = True
        sigval = signal.Signals(signum)
        raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)


def _makedirs(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path
