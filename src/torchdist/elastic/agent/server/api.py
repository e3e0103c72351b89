"""The elastic agent's interface and its run loop (torch.distributed.elastic.agent.server.api).

::

    ElasticAgent            run(role) -> RunResult, get_worker_group(role)           (abstract)
     └── SimpleElasticAgent the loop below, over four steps a subclass provides:
          │                 _start_workers, _stop_workers, _monitor_workers, _shutdown
          └── LocalElasticAgent (local_elastic_agent.py): the steps as local processes

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
joins late starts at 0. A handler written for torch's interface has no such
coordination calls (their defaults do nothing): with it the loop is torch's.

As torch's, the agent records ``torchelastic.worker.status.<STATE>`` events (to
``spec.event_log_handler``) and ``workers.<role>.*`` metrics (group ``torchelastic``): see ``_records.py``.
The module is the interface, the worker types and the loop together, as torch's is, hence its length.
"""

from __future__ import annotations

import abc
import enum
import inspect
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ...events import EventSource, record
from ...metrics import prof, put_metric
from ...multiprocessing.api import SignalException
from ...multiprocessing.errors import ProcessFailure
from ...rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
)
from ._records import _AgentRecords

__all__ = ["WorkerSpec", "Worker", "WorkerState", "WorkerGroup", "RunResult", "ElasticAgent", "SimpleElasticAgent"]

log = logging.getLogger(__name__)

DEFAULT_ROLE = "default"


@dataclass
class WorkerSpec:
    """What every worker of this node runs: ``entrypoint`` (an executable or a function) with ``args``.

    torch's fields; ``fn`` is the deprecated spelling of ``entrypoint``. ``master_addr``
    / ``master_port`` override where workers find the store; ``event_log_handler``
    names the events' destination (:func:`torchdist.elastic.events.get_logging_handler`).
    """

    role: str
    local_world_size: int
    rdzv_handler: RendezvousHandler
    fn: Callable | None = None
    entrypoint: Callable | str | None = None
    args: tuple = ()
    max_restarts: int = 3
    monitor_interval: float = 0.1
    master_port: int | None = None
    master_addr: str | None = None
    local_addr: str | None = None
    event_log_handler: str = "null"
    numa_options: Any = None  # accepted for torch's signature; there is no NUMA binding here
    duplicate_stdout_filters: list[str] | None = None
    duplicate_stderr_filters: list[str] | None = None
    virtual_local_rank: bool = False

    def __post_init__(self) -> None:
        if self.local_world_size < 1:
            raise ValueError(f"local_world_size must be >= 1, got {self.local_world_size}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not self.monitor_interval > 0:
            raise ValueError(f"monitor_interval must be > 0, got {self.monitor_interval}")
        if self.fn is not None:
            self.entrypoint = self.fn
        if isinstance(self.entrypoint, str) and self.entrypoint:
            return
        if not callable(self.entrypoint):
            raise TypeError(f"entrypoint must be an executable's path or name, or a function, got {self.entrypoint!r}")

    def get_entrypoint_name(self) -> str:
        """The executable's base name, or the function's ``__qualname__``."""
        if isinstance(self.entrypoint, str):
            return os.path.basename(self.entrypoint)
        return self.entrypoint.__qualname__  # type: ignore[union-attr]


class Worker:
    """One worker of this node, with its ranks in the current round; ``id`` is the agent's handle (a pid)."""

    __slots__ = ["id", "local_rank", "global_rank", "role_rank", "world_size", "role_world_size"]

    def __init__(self, local_rank: int, global_rank: int = -1, role_rank: int = -1, world_size: int = -1,
                 role_world_size: int = -1) -> None:
        self.id: Any = None
        self.local_rank = local_rank
        self.global_rank = global_rank
        self.role_rank = role_rank
        self.world_size = world_size
        self.role_world_size = role_world_size

    def __str__(self) -> str:
        return (f"local_rank={self.local_rank},global_rank={self.global_rank},role_rank={self.role_rank},"
                f"world_size={self.world_size},role_world_size={self.role_world_size}")

    __repr__ = __str__


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


class WorkerGroup:
    """This node's workers in one round; the round's fields are set by the rendezvous."""

    __slots__ = ["spec", "workers", "store", "group_rank", "group_world_size", "state", "master_addr",
                 "master_port", "rendezvous"]

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.workers = [Worker(local_rank=i) for i in range(spec.local_world_size)]
        self.store = None
        self.group_rank: int | None = None
        self.group_world_size: int | None = None
        self.master_addr: str | None = None
        self.master_port: int | None = None
        self.rendezvous: RendezvousInfo | None = None  # torchdist: the round, with its participants
        self.state = WorkerState.INIT


@dataclass
class RunResult:
    """How the run ended, by global rank: ``return_values`` on success, ``failures`` on failure.

    torchdist adds ``hosts`` (each failed rank's host, for other nodes' failures) and a ``note``.
    """

    state: WorkerState
    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    hosts: dict[int, str] = field(default_factory=dict)
    note: str = ""

    def is_failed(self) -> bool:
        return self.state == WorkerState.FAILED


def _next_rendezvous(handler: RendezvousHandler, local_world_size: int) -> RendezvousInfo:
    """torchdist's handlers take this node's number of workers; a handler written for torch's takes nothing."""
    if len(inspect.signature(handler.next_rendezvous).parameters) == 0:
        return handler.next_rendezvous()  # type: ignore[call-arg]
    return handler.next_rendezvous(local_world_size)


class ElasticAgent(abc.ABC):
    """Runs and watches one node's workers: ``result = agent.run()``; failed ranks in ``result.failures``."""

    @abc.abstractmethod
    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """Run the workers to the end (restarting them up to ``max_restarts`` times)."""

    @abc.abstractmethod
    def get_worker_group(self, role: str = DEFAULT_ROLE) -> WorkerGroup:
        """The (mutable) worker group of ``role``."""


class SimpleElasticAgent(_AgentRecords, ElasticAgent):
    """An agent of one worker role: the run loop of the module docstring over four abstract steps."""

    def __init__(self, spec: WorkerSpec, exit_barrier_timeout: float = 300, shutdown_timeout: float = 30) -> None:
        self._worker_group = WorkerGroup(spec)
        self._remaining_restarts = spec.max_restarts
        self._store = None
        self._exit_barrier_timeout = exit_barrier_timeout
        self._shutdown_timeout = shutdown_timeout
        self._total_execution_time = 0
        self._host = spec.local_addr or socket.getfqdn()
        self._multi_node = True  # refined once the first round is known

    def get_worker_group(self, role: str = DEFAULT_ROLE) -> WorkerGroup:
        return self._worker_group

    @property
    def restart_count(self) -> int:
        spec = self._worker_group.spec
        return spec.max_restarts - self._remaining_restarts

    # -- the steps a subclass provides ---------------------------------------------------
    @abc.abstractmethod
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        """Start ``local_world_size`` workers; returns ``{local_rank: worker id}``."""

    @abc.abstractmethod
    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        """Stop every worker, whatever its state (gone, stuck, running)."""

    @abc.abstractmethod
    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        """The group's state now (HEALTHY while running), with return values or failures when done."""

    @abc.abstractmethod
    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: float = 30) -> None:
        """Release what the agent holds: stop workers with ``death_sig``, SIGKILL after ``timeout`` s."""

    # -- rendezvous and (re)start ----------------------------------------------------------
    @prof
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        """Join the next round; give the workers their ranks in it."""
        spec = worker_group.spec
        with self.record_duration("RENDEZVOUS"):
            info = _next_rendezvous(spec.rdzv_handler, spec.local_world_size)
        self._multi_node = info.world_size > 1 or getattr(spec.rdzv_handler, "max_nodes", 2) > 1
        self._store = info.store
        store_info = info.bootstrap_store_info
        worker_group.rendezvous = info
        with self.record_duration("ASSIGN_WORKER_RANKS"):
            worker_group.workers = self._assign_worker_ranks(info.store, info.rank, info.world_size, spec)
        worker_group.store = info.store
        worker_group.group_rank, worker_group.group_world_size = info.rank, info.world_size
        worker_group.master_addr = spec.master_addr or (store_info.master_addr if store_info else None)
        worker_group.master_port = spec.master_port or (store_info.master_port if store_info else None)
        workers = worker_group.workers
        log.info("[%s] Rendezvous complete for workers. Result:\n  restart_count=%d\n  master_addr=%s\n"
                 "  master_port=%s\n  group_rank=%d\n  group_world_size=%d\n  local_ranks=%s\n  global_ranks=%s",
                 spec.role, self.restart_count, worker_group.master_addr, worker_group.master_port, info.rank,
                 info.world_size, [w.local_rank for w in workers], [w.global_rank for w in workers])

    @prof
    def _assign_worker_ranks(self, store: Any, group_rank: int, group_world_size: int,
                             spec: WorkerSpec) -> list[Worker]:
        """Global ranks follow the round's participant order (one role: role ranks are global ranks).

        torch's signature; the participants come from the round just formed (without them,
        every node is taken to run ``local_world_size`` workers, torch's fast path).
        """
        info = self._worker_group.rendezvous
        if info is None or info.rank != group_rank:
            info = RendezvousInfo(store, group_rank, group_world_size)
        offset, world = info.rank_offset(spec.local_world_size), info.num_workers(spec.local_world_size)
        return [Worker(local_rank=i, global_rank=offset + i, role_rank=offset + i, world_size=world,
                       role_world_size=world) for i in range(spec.local_world_size)]

    @prof
    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        """Rendezvous, then start the workers; the group is HEALTHY until ``_monitor_workers`` says otherwise."""
        worker_group.state = WorkerState.INIT
        self._rendezvous(worker_group)
        log.info("[%s] Starting worker group", worker_group.spec.role)
        for local_rank, worker_id in self._start_workers(worker_group).items():
            worker = worker_group.workers[local_rank]
            worker.id = worker_id
            record(self._construct_event("START", EventSource.WORKER, worker), worker_group.spec.event_log_handler)
        worker_group.state = WorkerState.HEALTHY

    @prof
    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        """Stop, then rendezvous and start again."""
        log.info("[%s] Stopping worker group", worker_group.spec.role)
        self._stop_workers(worker_group)
        worker_group.state = WorkerState.STOPPED
        self._initialize_workers(worker_group)

    # -- the run ---------------------------------------------------------------------------
    @prof
    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """Run to the end; the workers are stopped on any way out (return, error, signal)."""
        start = time.monotonic()
        shutdown_called = False
        try:
            result = self._invoke_run(role)
            self._total_execution_time = int(time.monotonic() - start)
            self._record_metrics(result)
            self._record_worker_events(result)
            return result
        except RendezvousGracefulExitError as exc:
            log.info("Rendezvous gracefully exited: %s", exc)
            return RunResult(WorkerState.SUCCEEDED, note=str(exc))
        except RendezvousConnectionError:
            self._worker_group.state = WorkerState.UNHEALTHY
            log.error("[%s] lost the rendezvous store; stopping the workers", self._worker_group.spec.role)
            raise
        except SignalException as exc:
            log.warning("Received %s death signal, shutting down workers", exc.sigval.name)
            self._shutdown(exc.sigval, timeout=self._shutdown_timeout)
            shutdown_called = True
            raise
        finally:
            if not shutdown_called:
                self._shutdown(timeout=self._shutdown_timeout)
            self._total_execution_time = int(time.monotonic() - start)

    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        group = self._worker_group
        spec = group.spec
        log.info("[%s] starting workers for entrypoint: %s", spec.role, spec.get_entrypoint_name())
        try:
            self._initialize_workers(group)
        except RendezvousClosedError as exc:
            return self._closed_result(exc)
        while True:
            time.sleep(spec.monitor_interval)
            result = self._monitor_workers(group)
            group.state = result.state
            put_metric(f"workers.{spec.role}.remaining_restarts", self._remaining_restarts)
            put_metric(f"workers.{spec.role}.{result.state.name.lower()}", 1)
            if result.state == WorkerState.SUCCEEDED:
                log.info("[%s] worker group successfully finished; waiting for the other nodes", spec.role)
                self._exit_barrier()
                return result
            if result.state in (WorkerState.UNHEALTHY, WorkerState.FAILED):
                ended = self._on_failure(result)
            elif result.state == WorkerState.HEALTHY:
                ended = self._on_healthy()
            else:
                raise RuntimeError(f"[{spec.role}] Worker group in {result.state.name} state")
            if ended is not None:
                return ended

    def _on_failure(self, result: RunResult) -> RunResult | None:
        """Restart if this node has restarts left (None: keep running), else the run's failed result."""
        group, spec = self._worker_group, self._worker_group.spec
        if self._remaining_restarts > 0:
            log.info("[%s] Worker group %s. %d/%d attempts left; will restart worker group", spec.role,
                     result.state.name, self._remaining_restarts, spec.max_restarts)
            self._remaining_restarts -= 1
            spec.rdzv_handler.request_restart(f"workers failed on {self._host}")
            return self._restart_or_closed()
        self._stop_workers(group)
        group.state = WorkerState.FAILED
        spec.rdzv_handler.report_failure(self._failure_summary(result))
        return result

    def _on_healthy(self) -> RunResult | None:
        """A restart decided elsewhere (or a change of membership): None to keep running."""
        reason = self._membership_change()
        if isinstance(reason, RunResult):
            return reason
        if reason:
            log.info("[%s] %s: restarting the worker group in a new round", self._worker_group.spec.role, reason)
            return self._restart_or_closed()
        return None

    def _restart_or_closed(self) -> RunResult | None:
        try:
            self._restart_workers(self._worker_group)
        except RendezvousClosedError:
            return self._closed_result(RendezvousClosedError("the rendezvous was closed while this node restarted"))
        return None

    def _membership_change(self) -> str | RunResult | None:
        """A reason to restart decided by another node (or a change of membership), if any."""
        if not self._multi_node:
            return None
        rdzv = self._worker_group.spec.rdzv_handler
        failed = rdzv.job_failure()
        if failed is not None:
            self._stop_workers(self._worker_group)
            return self._remote_failure_result(failed)
        request = rdzv.restart_request()
        if request is not None:  # only the failing node spends one of its restarts (torchrun's count)
            return f"node {request['node']} asked for a restart ({request['reason']})"
        waiting = rdzv.num_nodes_waiting()
        if waiting:
            rdzv.request_restart(f"{waiting} node(s) waiting to join")
            return f"{waiting} node(s) waiting to join"
        lost = rdzv.lost_nodes()
        if lost:
            rdzv.request_restart(f"node(s) {', '.join(lost)} left")
            return f"node(s) {', '.join(lost)} left or stopped sending heartbeats"
        return None

    def _exit_barrier(self) -> None:
        """Wait (up to ``exit_barrier_timeout``) for the other nodes to finish, so none looks lost."""
        self._worker_group.spec.rdzv_handler.exit_barrier(self._exit_barrier_timeout)

    # -- results -------------------------------------------------------------------------
    def _failure_summary(self, result: RunResult) -> dict:
        rdzv = self._worker_group.spec.rdzv_handler
        return {"node": getattr(rdzv, "node_id", self._host), "host": self._host,
                "failures": {str(rank): f.to_dict() for rank, f in result.failures.items()}}

    def _remote_failure_result(self, summary: dict) -> RunResult:
        failures = {int(rank): ProcessFailure.from_dict(data) for rank, data in summary["failures"].items()}
        return RunResult(WorkerState.FAILED, failures=failures, hosts=dict.fromkeys(failures, summary["host"]),
                         note=f"The job failed on node {summary['node']} ({summary['host']}); this node's workers "
                              "were stopped.")

    def _closed_result(self, exc: RendezvousClosedError) -> RunResult:
        failed = self._worker_group.spec.rdzv_handler.job_failure()
        if failed is not None:
            return self._remote_failure_result(failed)
        log.warning("%s; this node has nothing to do", exc)
        return RunResult(WorkerState.SUCCEEDED, note=str(exc))
