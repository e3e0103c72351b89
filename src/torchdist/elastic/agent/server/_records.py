"""What :class:`~.api.SimpleElasticAgent` records, with torch's names: worker events and run metrics.

A mixin, kept apart so that the run loop reads on its own: ``torchelastic.worker.status.<STATE>``
events go to ``spec.event_log_handler``; ``workers.<role>.*`` metrics to group ``torchelastic``.
"""

from __future__ import annotations

import json
import time
import traceback
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

from ...events import Event, EventSource, record
from ...metrics import put_metric

if TYPE_CHECKING:
    from .api import RunResult, Worker, WorkerGroup

__all__: list[str] = []


class _AgentRecords:
    """Events and metrics of one agent; the agent provides the attributes below."""

    _worker_group: "WorkerGroup"
    _remaining_restarts: int
    _total_execution_time: int
    _host: str
    restart_count: int

    # -- events and metrics (torch's names) ------------------------------------------------
    def get_event_failed(self) -> Event:
        return self._construct_event("FAILED", EventSource.AGENT, raw_error=traceback.format_exc())

    def get_event_succeeded(self) -> Event:
        return self._construct_event("SUCCEEDED", EventSource.AGENT)

    @contextmanager
    def record_duration(self, state: str) -> Iterator[None]:
        """Record an AGENT event ``state`` with the block's duration in ms."""
        start = time.perf_counter()
        try:
            yield
        finally:
            duration_ms = (time.perf_counter() - start) * 1000
            record(self._construct_event(state, EventSource.AGENT, duration_ms=duration_ms),
                   self._worker_group.spec.event_log_handler)

    def _record_worker_events(self, result: RunResult) -> None:
        for worker in self._worker_group.workers:
            failure = result.failures.get(worker.global_rank)
            record(self._construct_event(
                self._get_worker_state(worker, result), EventSource.WORKER, worker,
                raw_error=json.dumps(failure.error_file_data) if failure else None,
                exit_code=failure.exitcode if failure else None, worker_pid=failure.pid if failure else None,
            ), self._worker_group.spec.event_log_handler)

    @staticmethod
    def _get_worker_state(worker: Worker, result: RunResult) -> str:
        """TERMINATED for a worker the agent stopped because others failed, else the run's state."""
        # WorkerState is a str enum: compared by value, without importing api.py (which imports this module)
        if result.state in ("UNHEALTHY", "FAILED") and worker.global_rank not in result.failures:
            return "TERMINATED"
        return result.state.value

    def _construct_event(self, state: str, source: EventSource, worker: Worker | None = None,
                         raw_error: str | None = None, duration_ms: float | None = None,
                         exit_code: int | None = None, worker_pid: int | None = None) -> Event:
        group, spec = self._worker_group, self._worker_group.spec
        md: dict[str, Any] = {"group_world_size": group.group_world_size, "entry_point": spec.get_entrypoint_name()}
        if worker is not None:  # torch's one-element tuples, kept for readers of its JSON
            md.update(local_rank=(worker.local_rank,), role_rank=(worker.role_rank,),
                      role_world_size=(worker.role_world_size,), exit_code=(exit_code,), worker_pid=(worker_pid,))
        metadata = {
            "run_id": spec.rdzv_handler.get_run_id(),
            "global_rank": worker.global_rank if worker else None,
            "group_rank": group.group_rank,
            "worker_id": str(worker.id) if worker else None,
            "role": spec.role,
            "hostname": self._host,
            "state": state,
            "total_run_time": self._total_execution_time,
            "rdzv_backend": spec.rdzv_handler.get_backend(),
            "raw_error": raw_error,
            "metadata": json.dumps(md),
            "agent_restarts": self.restart_count,
            "duration_ms": duration_ms,
        }
        return Event(f"torchelastic.worker.status.{state}", source=source, metadata=metadata)

    def _record_metrics(self, result: RunResult) -> None:
        role = self._worker_group.spec.role
        failed, restarted = result.is_failed(), self.restart_count > 0
        flakiness = 100.0 if failed else 100.0 - 100.0 * (self._remaining_restarts + 1) / (
            self._worker_group.spec.max_restarts + 1)
        put_metric(f"workers.{role}.flakiness", int(flakiness))
        put_metric(f"workers.{role}.run_total", 1)
        for name, condition in (("run_success_with_retries", not failed and restarted),
                                ("run_success_no_retries", not failed and not restarted),
                                ("run_failed_with_retries", failed and restarted),
                                ("run_failed_no_retries", failed and not restarted)):
            put_metric(f"workers.{role}.{name}", int(condition))
