"""A custom SimpleElasticAgent program, written for torch.distributed.elastic, run on either library.

``python custom_agent_program.py torch|torchdist`` prints one JSON object of what it
observed (the steps the agent took, the result, the metrics and events recorded),
so that a test can compare the two libraries. The rendezvous handler is written
against torch's interface (``next_rendezvous()`` with no argument) and forms a
one-node round; the "workers" are fake: the first attempt fails, the second succeeds.
"""

import json
import logging
import os
import signal
import sys

LIB = sys.argv[1]
if LIB == "torch":
    import torch.distributed as dist
    from torch.distributed.elastic import events, metrics
    from torch.distributed.elastic.agent.server import RunResult, SimpleElasticAgent, WorkerSpec, WorkerState
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo
else:
    import torchdist as dist
    from torchdist.elastic import events, metrics
    from torchdist.elastic.agent.server import RunResult, SimpleElasticAgent, WorkerSpec, WorkerState
    from torchdist.elastic.multiprocessing.errors import ProcessFailure
    from torchdist.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo

os.environ["TORCH_ELASTIC_WORKER_IDENTICAL"] = "1"  # torch's fast path of rank assignment (no store traffic)


class OneNodeRendezvous(RendezvousHandler):
    def __init__(self):
        self.store = dist.HashStore()
        self.rounds = 0

    def get_backend(self):
        return "one-node"

    def next_rendezvous(self):
        self.rounds += 1
        return RendezvousInfo(self.store, 0, 1, RendezvousStoreInfo("localhost", 29999))

    def is_closed(self):
        return False

    def set_closed(self):
        pass

    def num_nodes_waiting(self):
        return 0

    def get_run_id(self):
        return "job"

    def shutdown(self):
        return True


class FakeAgent(SimpleElasticAgent):
    def __init__(self, spec):
        super().__init__(spec, exit_barrier_timeout=5)
        self.steps = []
        self.attempt = 0

    def _start_workers(self, worker_group):
        self.attempt += 1
        self.steps.append(["start", [(w.local_rank, w.global_rank, w.world_size) for w in worker_group.workers]])
        return {w.local_rank: 1000 * self.attempt + w.local_rank for w in worker_group.workers}

    def _stop_workers(self, worker_group):
        self.steps.append(["stop"])

    def _monitor_workers(self, worker_group):
        self.steps.append(["monitor", worker_group.state.value])
        ranks = [w.global_rank for w in worker_group.workers]
        if self.attempt == 1:
            return RunResult(WorkerState.FAILED, failures={ranks[1]: ProcessFailure(1, 1001, 3, "")})
        return RunResult(WorkerState.SUCCEEDED, return_values={r: f"ok{r}" for r in ranks})

    def _shutdown(self, death_sig=signal.SIGTERM, timeout=30):
        self.steps.append(["shutdown", signal.Signals(death_sig).name])


class Metrics(metrics.MetricHandler):
    def __init__(self):
        self.names = []

    def emit(self, metric_data):
        self.names.append([metric_data.group_name, metric_data.name, metric_data.value])


class Events(logging.Handler):
    def __init__(self):
        super().__init__()
        self.events = []

    def emit(self, record_):
        event = events.Event.deserialize(record_.getMessage())
        self.events.append([event.name, event.source.value, event.metadata["global_rank"], event.metadata["state"]])


def main():
    sink, captured = Metrics(), Events()
    metrics.configure(sink, group="torchelastic")
    events.handlers._log_handlers["capture"] = captured
    spec = WorkerSpec(role="trainer", local_world_size=2, rdzv_handler=OneNodeRendezvous(), entrypoint="/bin/true",
                      max_restarts=1, monitor_interval=0.01, event_log_handler="capture")
    agent = FakeAgent(spec)
    result = agent.run()
    durations = {".duration.ms", "duration_ms"}
    print(json.dumps({
        "state": result.state.value,
        "return_values": {str(k): v for k, v in result.return_values.items()},
        "failures": sorted(result.failures),
        "steps": agent.steps,
        "rounds": spec.rdzv_handler.rounds,
        "group": [agent.get_worker_group().group_rank, agent.get_worker_group().group_world_size,
                  agent.get_worker_group().master_addr, agent.get_worker_group().master_port],
        # durations vary from run to run: keep the metric's name, not its value
        "metrics": [[g, n, None if any(n.endswith(d) for d in durations) else v] for g, n, v in sink.names],
        "events": captured.events,
    }))


if __name__ == "__main__":
    main()
