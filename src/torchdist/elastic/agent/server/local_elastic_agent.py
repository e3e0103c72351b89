"""The local elastic agent: one per node; it runs this node's workers as local processes.

torch's :class:`LocalElasticAgent`: ``_start_workers`` gives every worker torchrun's
environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``,
``TORCHELASTIC_*``...) and starts them with
:func:`~torchdist.elastic.multiprocessing.start_processes`, their output placed by
``logs_specs``; ``_monitor_workers`` polls them; ``_stop_workers`` and ``_shutdown``
close them (the death signal, then SIGKILL after ``shutdown_timeout``).

torchdist adds, keyword-only: ``extra_env`` (e.g. the job secret), the signals the
launcher forwards to its workers (``signals_to_handle``; a second signal while
stopping does not interrupt the stop), and a start failure (a missing executable)
reported as every worker failing with exit code 127, as a shell would.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from string import Template
from types import FrameType
from typing import Any, Mapping

from ...multiprocessing import start_processes
from ...multiprocessing.api import PContext, SignalException
from ...multiprocessing.errors import ProcessFailure
from ...multiprocessing.logs_specs import LogsSpecs
from .api import DEFAULT_ROLE, RunResult, SimpleElasticAgent, WorkerGroup, WorkerSpec, WorkerState

__all__ = ["LocalElasticAgent", "TORCHELASTIC_ENABLE_FILE_TIMER", "TORCHELASTIC_HEALTH_CHECK_PORT",
           "TORCHELASTIC_TIMER_FILE", "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT"]

log = logging.getLogger(__name__)

# torch's names of its watchdog settings; torchdist has no file timer or health-check server.
TORCHELASTIC_ENABLE_FILE_TIMER = "TORCHELASTIC_ENABLE_FILE_TIMER"
TORCHELASTIC_HEALTH_CHECK_PORT = "TORCHELASTIC_HEALTH_CHECK_PORT"
TORCHELASTIC_TIMER_FILE = "TORCHELASTIC_TIMER_FILE"
TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT = "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT"

DEFAULT_LOG_LINE_PREFIX_TEMPLATE = "[${role_name}${local_rank}]:"
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class LocalElasticAgent(SimpleElasticAgent):
    """Runs ``spec`` as local processes until it succeeds, fails for good, or the launcher is signalled."""

    def __init__(self, spec: WorkerSpec, logs_specs: LogsSpecs, start_method: str = "spawn",
                 exit_barrier_timeout: float = 300, log_line_prefix_template: str | None = None,
                 shutdown_timeout: float = 30, *, extra_env: Mapping[str, str] | None = None,
                 signals_to_handle: tuple[int, ...] = DEFAULT_SIGNALS) -> None:
        super().__init__(spec, exit_barrier_timeout, shutdown_timeout)
        self._start_method = start_method
        self._logs_specs = logs_specs
        self._log_line_prefix_template = log_line_prefix_template or DEFAULT_LOG_LINE_PREFIX_TEMPLATE
        self._extra_env = dict(extra_env or {})
        self._signals = tuple(signals_to_handle)
        self._pcontext: PContext | None = None
        self._start_failure: RunResult | None = None  # the workers of this round could not be started
        self._signalled = False

    # -- the four steps --------------------------------------------------------------------
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        spec = worker_group.spec
        envs = {w.local_rank: self._worker_env(worker_group, w) for w in worker_group.workers}
        args = {w.local_rank: tuple(a.replace("${local_rank}", str(w.local_rank)) if isinstance(a, str) else a
                                    for a in spec.args) for w in worker_group.workers}
        prefixes = {w.local_rank: Template(self._log_line_prefix_template).safe_substitute(
            role_name=spec.role, rank=w.global_rank, local_rank=w.local_rank) for w in worker_group.workers}
        self._start_failure = None
        try:
            self._pcontext = start_processes(
                name=spec.role, entrypoint=spec.entrypoint, args=args, envs=envs, logs_specs=self._logs_specs,
                log_line_prefixes=prefixes, start_method=self._start_method,
                duplicate_stdout_filters=spec.duplicate_stdout_filters,
                duplicate_stderr_filters=spec.duplicate_stderr_filters)
        except OSError as exc:  # e.g. --no-python with a missing executable: every worker fails as a shell would
            self._start_failure = self._cannot_start(worker_group, exc)
            return {}
        self._pcontext.shutdown_timeout = self._shutdown_timeout
        return self._pcontext.pids()

    def _worker_env(self, group: WorkerGroup, worker) -> dict[str, str]:
        """torchrun's worker environment (over the launcher's own, which the worker inherits)."""
        spec = group.spec
        env = {
            "LOCAL_RANK": "0" if spec.virtual_local_rank else str(worker.local_rank),
            "RANK": str(worker.global_rank),
            "GROUP_RANK": str(group.group_rank),
            "ROLE_RANK": str(worker.role_rank),
            "ROLE_NAME": spec.role,
            "LOCAL_WORLD_SIZE": str(spec.local_world_size),
            "WORLD_SIZE": str(worker.world_size),
            "GROUP_WORLD_SIZE": str(group.group_world_size),
            "ROLE_WORLD_SIZE": str(worker.role_world_size),
            "MASTER_ADDR": str(group.master_addr),
            "MASTER_PORT": str(group.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(self.restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "TORCHELASTIC_RUN_ID": spec.rdzv_handler.get_run_id(),
            "TORCHELASTIC_USE_AGENT_STORE": str(spec.rdzv_handler.use_agent_store),
            "TORCHELASTIC_SIGNALS_TO_HANDLE": ",".join(signal.Signals(s).name for s in self._signals),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        }
        env.update(self._extra_env)
        return env

    def _cannot_start(self, group: WorkerGroup, exc: OSError) -> RunResult:
        log.error("[%s] cannot start %s: %s", group.spec.role, group.spec.entrypoint, exc)
        failures = {}
        for worker in group.workers:
            failure = ProcessFailure(worker.local_rank, -1, 127, "")
            failure.message = f"cannot start {group.spec.entrypoint!r}: {exc}"
            failures[worker.global_rank] = failure
        return RunResult(WorkerState.FAILED, failures=failures, hosts=dict.fromkeys(failures, self._host))

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        if self._start_failure is not None:
            return self._start_failure
        if self._pcontext is None:
            raise RuntimeError("_monitor_workers called before _start_workers")
        result = self._pcontext.wait(0)
        if result is None:
            return RunResult(WorkerState.HEALTHY)
        to_global = {w.local_rank: w.global_rank for w in worker_group.workers}
        if result.is_failed():
            failures = {to_global[local]: f for local, f in result.failures.items()}
            return RunResult(WorkerState.FAILED, failures=failures, hosts=dict.fromkeys(failures, self._host))
        return RunResult(WorkerState.SUCCEEDED,
                         return_values={to_global[local]: v for local, v in result.return_values.items()})

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._shutdown(signal.SIGTERM, self._shutdown_timeout)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: float = 30) -> None:
        if self._pcontext is not None:
            self._pcontext.close(death_sig, timeout)
            self._pcontext = None
            self._worker_group.state = WorkerState.STOPPED

    # -- signals -----------------------------------------------------------------------------
    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """:meth:`SimpleElasticAgent.run`, with the launcher's signals forwarded to the workers."""
        previous = self._install_signal_handlers()
        try:
            return super().run(role)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _install_signal_handlers(self) -> dict[int, Any]:
        previous: dict[int, Any] = {}
        if sys.platform == "win32":
            return previous
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
