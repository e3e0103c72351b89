"""torch.distributed.elastic.agent's path: the agent lives in :mod:`.server`. Re-exports only."""

from ..multiprocessing.api import SignalException
from .server import (
    ElasticAgent,
    LocalElasticAgent,
    RunResult,
    SimpleElasticAgent,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)

__all__ = ["ElasticAgent", "LocalElasticAgent", "RunResult", "SignalException", "SimpleElasticAgent", "Worker",
           "WorkerGroup", "WorkerSpec", "WorkerState"]
