"""The agent's class hierarchy (torch's): a custom SimpleElasticAgent, and LocalElasticAgent used directly."""

from __future__ import annotations

import os
import signal

import pytest

from torchdist.elastic.agent.server import (
    ElasticAgent,
    LocalElasticAgent,
    RunResult,
    SimpleElasticAgent,
    WorkerSpec,
    WorkerState,
)
from torchdist.elastic.multiprocessing import DefaultLogsSpecs, ProcessFailure, SignalException, Std
from torchdist.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torchdist.testing import free_port

pytestmark = pytest.mark.timeout(60)


def _c10d_handler():
    params = RendezvousParameters("c10d", f"localhost:{free_port()}", "agent-test", 1, 1, join_timeout="10",
                                  last_call_timeout="0.1")
    return rendezvous_handler_registry.create_handler(params)


class ScriptedAgent(SimpleElasticAgent):
    """Fake workers: ``outcomes`` says how each attempt ends (after one HEALTHY poll)."""

    def __init__(self, spec: WorkerSpec, outcomes: list) -> None:
        super().__init__(spec, exit_barrier_timeout=5, shutdown_timeout=1)
        self.outcomes = outcomes
        self.calls: list = []
        self.polls = 0

    def _start_workers(self, worker_group):
        self.calls.append(("start", [(w.local_rank, w.global_rank, w.world_size) for w in worker_group.workers]))
        self.polls = 0
        return {w.local_rank: f"w{len(self.calls)}-{w.local_rank}" for w in worker_group.workers}

    def _stop_workers(self, worker_group):
        self.calls.append(("stop",))

    def _monitor_workers(self, worker_group):
        self.polls += 1
        if self.polls == 1:
            return RunResult(WorkerState.HEALTHY)
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        ranks = [w.global_rank for w in worker_group.workers]
        if outcome == "fail":
            return RunResult(WorkerState.FAILED, failures={ranks[0]: ProcessFailure(0, 42, 7, "")})
        return RunResult(WorkerState.SUCCEEDED, return_values={r: r * 10 for r in ranks})

    def _shutdown(self, death_sig=signal.SIGTERM, timeout=30):
        self.calls.append(("shutdown", signal.Signals(death_sig).name))


def _spec(handler, **kwargs) -> WorkerSpec:
    return WorkerSpec(role="trainer", local_world_size=2, rdzv_handler=handler, entrypoint="/bin/true",
                      monitor_interval=0.01, **kwargs)


def test_a_custom_agent_is_driven_by_run_over_a_real_rendezvous():
    handler = _c10d_handler()
    try:
        agent = ScriptedAgent(_spec(handler, max_restarts=2), ["fail", "ok"])
        assert isinstance(agent, ElasticAgent)
        result = agent.run()
    finally:
        handler.shutdown()
    assert result.state == WorkerState.SUCCEEDED and result.return_values == {0: 0, 1: 10}
    assert agent.calls == [("start", [(0, 0, 2), (1, 1, 2)]), ("stop",), ("start", [(0, 0, 2), (1, 1, 2)]),
                           ("shutdown", "SIGTERM")]
    group = agent.get_worker_group()
    assert group.state == WorkerState.SUCCEEDED and (group.group_rank, group.group_world_size) == (0, 1)
    assert group.master_addr == "localhost" and group.master_port == handler.endpoint[1]
    assert [w.id for w in group.workers] == ["w3-0", "w3-1"] and agent.restart_count == 1


def test_without_restarts_left_the_failure_is_the_result():
    handler = _c10d_handler()
    try:
        agent = ScriptedAgent(_spec(handler, max_restarts=0), ["fail"])
        result = agent.run()
    finally:
        handler.shutdown()
    assert result.is_failed() and list(result.failures) == [0] and result.failures[0].exitcode == 7
    assert agent.calls[-2:] == [("stop",), ("shutdown", "SIGTERM")]


def test_a_signal_shuts_the_workers_down_with_that_signal():
    handler = _c10d_handler()
    try:
        agent = ScriptedAgent(_spec(handler), [SignalException("got SIGINT", signal.SIGINT)])
        with pytest.raises(SignalException):
            agent.run()
    finally:
        handler.shutdown()
    assert agent.calls[-1] == ("shutdown", "SIGINT")


def _whoami(tag: str) -> tuple:
    return tag, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ["TORCHELASTIC_RUN_ID"]


def test_local_elastic_agent_runs_a_function_as_torch_documents(tmp_path):
    handler = _c10d_handler()
    try:
        spec = WorkerSpec(role="trainer", local_world_size=2, rdzv_handler=handler, entrypoint=_whoami, args=("x",),
                          max_restarts=0)
        agent = LocalElasticAgent(spec, DefaultLogsSpecs(log_dir=str(tmp_path), redirects=Std.ALL))
        result = agent.run()
    finally:
        handler.shutdown()
    assert result.state == WorkerState.SUCCEEDED
    assert result.return_values == {0: ("x", 0, 2, "agent-test"), 1: ("x", 1, 2, "agent-test")}
    assert sorted(p.name for p in tmp_path.glob("agent-test_*/attempt_0/*")) == ["0", "1"]


def test_worker_spec_validates_and_names_its_entrypoint():
    handler = object()
    assert WorkerSpec("r", 1, handler, entrypoint="/usr/bin/env").get_entrypoint_name() == "env"
    assert WorkerSpec("r", 1, handler, fn=_whoami).get_entrypoint_name() == "_whoami"  # fn: the deprecated spelling
    with pytest.raises(ValueError, match="local_world_size"):
        WorkerSpec("r", 0, handler, entrypoint="x")
    with pytest.raises(TypeError, match="entrypoint"):
        WorkerSpec("r", 1, handler)
