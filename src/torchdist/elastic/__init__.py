"""torchdist.elastic: the launcher's elastic agent (torch.distributed.elastic), re-exports only.

::

    config.py           LaunchConfig: the launch, typed and validated
    launch.py           launch_agent / elastic_launch: rendezvous + agent + report; the job secret
    agent.py            LocalElasticAgent and the worker-state machine (drawn in its docstring)
    rendezvous/         how nodes agree on rounds: c10d (dynamic) and static, over a TCPStore
    multiprocessing/    worker processes (no orphans), output tee, @record and ChildFailedError

``torchdist-run`` (:mod:`torchdist.run`) is the command line on top.
"""

from .agent import LocalElasticAgent, RunResult, SignalException, Worker, WorkerGroup, WorkerSpec, WorkerState
from .config import LaunchConfig
from .launch import elastic_launch, launch_agent
from .multiprocessing.errors import ChildFailedError, record

__all__ = [
    "ChildFailedError",
    "LaunchConfig",
    "LocalElasticAgent",
    "RunResult",
    "SignalException",
    "Worker",
    "WorkerGroup",
    "WorkerSpec",
    "WorkerState",
    "elastic_launch",
    "launch_agent",
    "record",
]
