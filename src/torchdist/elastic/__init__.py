"""torchdist.elastic: the launcher's elastic agent (torch.distributed.elastic), re-exports only.

::

    config.py           LaunchConfig: the launch, typed and validated
    launch.py           launch_agent / elastic_launch: rendezvous + agent + report; the job secret
    agent/server/       ElasticAgent -> SimpleElasticAgent (the run loop, the worker-state machine)
                        -> LocalElasticAgent (the workers as local processes)
    rendezvous/         how nodes agree on rounds: c10d (dynamic) and static, over a TCPStore; the registry
    multiprocessing/    start_processes: worker processes (no orphans), their logs, @record, ChildFailedError
    events/, metrics/   what the agent and the rendezvous record, through handlers a program configures

``torchdist-run`` (:mod:`torchdist.run`) is the command line on top.
docs/design/elastic.md says what differs from torch.
"""

from .agent.server import (
    ElasticAgent,
    LocalElasticAgent,
    RunResult,
    SimpleElasticAgent,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from .config import LaunchConfig
from .launch import elastic_launch, launch_agent
from .multiprocessing.api import SignalException
from .multiprocessing.errors import ChildFailedError, record

__all__ = [
    "ChildFailedError",
    "ElasticAgent",
    "LaunchConfig",
    "LocalElasticAgent",
    "RunResult",
    "SignalException",
    "SimpleElasticAgent",
    "Worker",
    "WorkerGroup",
    "WorkerSpec",
    "WorkerState",
    "elastic_launch",
    "launch_agent",
    "record",
]
