"""Events, metrics and the rendezvous registry: torch's front, handlers a program installs."""

from __future__ import annotations

import logging

import pytest

from torchdist.elastic import events, metrics
from torchdist.elastic.events import Event, EventSource, NodeState, RdzvEvent
from torchdist.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousHandlerRegistry,
    RendezvousParameters,
    StoreRendezvousHandler,
    rendezvous_handler_registry,
)
from torchdist.elastic.rendezvous.registry import get_rendezvous_handler
from torchdist.testing import free_port

pytestmark = pytest.mark.timeout(60)


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def destination(monkeypatch):
    """An event destination named "capture" (and "dynamic_rendezvous" routed to it), removed afterwards."""
    capture = Capture()
    monkeypatch.setitem(events.handlers._log_handlers, "capture", capture)
    monkeypatch.setitem(events.handlers._log_handlers, "dynamic_rendezvous", capture)
    monkeypatch.setattr(events, "_events_loggers", {})
    yield capture
    for name in ("capture", "dynamic_rendezvous"):
        logging.getLogger(f"torchelastic-events-{name}").removeHandler(capture)


def test_events_are_recorded_as_json_through_the_destinations_handler(destination):
    event = Event("torchelastic.worker.status.START", EventSource.WORKER, 5, {"global_rank": 1})
    events.record(event, "capture")
    events.record(event)  # "null": dropped
    assert destination.lines == [event.serialize()]
    assert Event.deserialize(destination.lines[0]) == event and str(event) == event.serialize()
    assert events.get_logging_handler("capture") is destination
    with pytest.raises(KeyError):
        events.get_logging_handler("nowhere")


def test_rdzv_events_name_their_caller_and_cost_nothing_by_default(destination, monkeypatch):
    events.construct_and_record_rdzv_event(run_id="job", message="hello", node_state=NodeState.INIT, rank=3)
    recorded = RdzvEvent.deserialize(destination.lines[-1])
    assert recorded.name == "test_events_metrics.py:test_rdzv_events_name_their_caller_and_cost_nothing_by_default"
    assert (recorded.run_id, recorded.message, recorded.rank, recorded.node_state) == ("job", "hello", 3,
                                                                                        NodeState.INIT)
    monkeypatch.setitem(events.handlers._log_handlers, "dynamic_rendezvous", logging.NullHandler())
    count = len(destination.lines)
    events.construct_and_record_rdzv_event(run_id="job", message="dropped", node_state=NodeState.RUNNING)
    assert len(destination.lines) == count


def test_the_c10d_rendezvous_records_its_rounds(destination):
    handler = get_rendezvous_handler(RendezvousParameters("c10d", f"localhost:{free_port()}", "job", 1, 1,
                                                          last_call_timeout="0.1"))
    try:
        handler.next_rendezvous(2)
    finally:
        handler.shutdown()
    messages = [RdzvEvent.deserialize(line) for line in destination.lines]
    assert [(e.message, e.node_state) for e in messages] == [("joining the next round with 2 workers", NodeState.INIT),
                                                            ("round 0 formed with 1 nodes", NodeState.RUNNING)]
    assert messages[1].rank == 0 and messages[1].master_endpoint.startswith("localhost:")


class Sink(metrics.MetricHandler):
    def __init__(self) -> None:
        self.data: list[metrics.MetricData] = []

    def emit(self, metric_data: metrics.MetricData) -> None:
        self.data.append(metric_data)


@pytest.fixture
def sink(monkeypatch):
    handler = Sink()
    monkeypatch.setattr(metrics.api, "_metrics_map", {})
    monkeypatch.setattr(metrics.api, "_default_metrics_handler", metrics.NullMetricHandler())
    metrics.configure(handler, group="g")
    return handler


class Trainer:
    @metrics.prof(group="g")
    def step(self, fail: bool = False) -> str:
        if fail:
            raise RuntimeError("step failed")
        return "done"


@metrics.prof(group="g")
def load() -> int:
    return 1


def test_prof_publishes_success_failure_and_duration(sink):
    assert Trainer().step() == "done" and load() == 1
    with pytest.raises(RuntimeError):
        Trainer().step(fail=True)
    names = [(d.group_name, d.name) for d in sink.data]
    assert names == [("g", "Trainer.step.success"), ("g", "Trainer.step.duration.ms"),
                     ("g", "test_events_metrics.load.success"), ("g", "test_events_metrics.load.duration.ms"),
                     ("g", "Trainer.step.failure"), ("g", "Trainer.step.duration.ms")]
    assert all(d.value >= 0 and d.timestamp > 0 for d in sink.data)


def test_put_metric_goes_to_its_groups_handler_else_the_default(sink):
    metrics.put_metric("loss", 3, "g")
    metrics.put_metric("ignored", 1, "other")  # the default handler: Null
    default = Sink()
    metrics.configure(default)
    metrics.put_metric("seen", 2, "other")
    metrics.getStream("g").add_value("direct", 4)
    assert [(d.name, d.value) for d in sink.data] == [("loss", 3), ("direct", 4)]
    assert [(d.group_name, d.name, d.value) for d in default.data] == [("other", "seen", 2)]
    with pytest.warns(FutureWarning):
        metrics.publish_metric("g", "old", 5)
    assert sink.data[-1].name == "old" and metrics.MetricsConfig().params == {}


def test_console_handler_prints_torchs_format(capsys):
    metrics.ConsoleMetricHandler().emit(metrics.MetricData(1.5, "grp", "m", 7))
    assert capsys.readouterr().out == "[1.5][grp]: m=7\n"


class MineHandler(RendezvousHandler):
    """A handler written to torch's interface only (no coordination calls)."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id

    def get_backend(self) -> str:
        return "mine"

    def get_run_id(self) -> str:
        return self.run_id

    def next_rendezvous(self):
        raise NotImplementedError

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def shutdown(self) -> bool:
        return True


def test_the_registry_creates_a_handler_by_backend_name():
    registry = RendezvousHandlerRegistry()
    created = []

    def creator(params):
        created.append(MineHandler(params.run_id))
        return created[-1]

    registry.register("mine", creator)
    registry.register("mine", creator)  # the same creator again: allowed, as torch's
    with pytest.raises(ValueError, match="already registered"):
        registry.register("mine", lambda params: None)
    handler = registry.create_handler(RendezvousParameters("mine", "localhost:0", "job", 1, 1))
    assert handler is created[0] and handler.get_run_id() == "job" and "mine" in registry
    with pytest.raises(ValueError, match="'etcd' is not registered.*'mine'"):
        registry.create_handler(RendezvousParameters("etcd", "h:1", "job", 1, 1))


def test_the_process_registry_knows_c10d_and_static():
    assert {"c10d", "static"} <= set(rendezvous_handler_registry.backends())
    params = RendezvousParameters("c10d", f"localhost:{free_port()}", "job", 1, 1, join_timeout="5")
    assert params.config == {"join_timeout": "5"}  # torch's **kwargs are configuration
    handler = rendezvous_handler_registry.create_handler(params)
    try:
        assert isinstance(handler, StoreRendezvousHandler) and handler.get_backend() == "c10d"
    finally:
        handler.shutdown()
