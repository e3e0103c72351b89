"""The elastic agent (torch.distributed.elastic.agent.server), re-exports only.

The agent is the control plane of an elastic job: one per node, it rendezvouses
with the other nodes, starts this node's workers with everything they need to call
``init_process_group()``, watches them, and restarts the whole group on failure or
membership change. :mod:`.api` holds the interface and the run loop,
:mod:`.local_elastic_agent` the agent of local processes.
"""

from .api import ElasticAgent, RunResult, SimpleElasticAgent, Worker, WorkerGroup, WorkerSpec, WorkerState
from .local_elastic_agent import TORCHELASTIC_ENABLE_FILE_TIMER, TORCHELASTIC_TIMER_FILE, LocalElasticAgent

__all__ = ["ElasticAgent", "LocalElasticAgent", "RunResult", "SimpleElasticAgent", "TORCHELASTIC_ENABLE_FILE_TIMER",
           "TORCHELASTIC_TIMER_FILE", "Worker", "WorkerGroup", "WorkerSpec", "WorkerState"]
