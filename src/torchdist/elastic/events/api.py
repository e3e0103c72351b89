"""The event records of an elastic job (torch.distributed.elastic.events.api): agent/worker events and
rendezvous events, each serialized as one JSON line."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Union

__all__ = ["EventSource", "Event", "NodeState", "RdzvEvent"]

EventMetadataValue = Union[str, int, float, bool, None]


class EventSource(str, Enum):
    """Who produced an event."""

    AGENT = "AGENT"
    WORKER = "WORKER"


@dataclass
class Event:
    """Something that happened to the agent or a worker: ``name``, ``source``, a timestamp (ms), metadata."""

    name: str
    source: EventSource
    timestamp: int = 0
    metadata: dict[str, EventMetadataValue] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.serialize()

    @staticmethod
    def deserialize(data: "str | Event") -> "Event":
        if isinstance(data, Event):
            return data
        fields = json.loads(data)
        fields["source"] = EventSource[fields["source"]]
        return Event(**fields)

    def serialize(self) -> str:
        return json.dumps(asdict(self))


class NodeState(str, Enum):
    """A node's state in the rendezvous."""

    INIT = "INIT"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"


@dataclass
class RdzvEvent:
    """One step of a node's rendezvous (joined, round formed, closed...)."""

    name: str
    run_id: str
    message: str
    hostname: str
    pid: int
    node_state: NodeState
    master_endpoint: str = ""
    rank: int | None = None
    local_id: int | None = None
    error_trace: str = ""

    def __str__(self) -> str:
        return self.serialize()

    @staticmethod
    def deserialize(data: "str | RdzvEvent") -> "RdzvEvent":
        if isinstance(data, RdzvEvent):
            return data
        fields = json.loads(data)
        fields["node_state"] = NodeState[fields["node_state"]]
        return RdzvEvent(**fields)

    def serialize(self) -> str:
        return json.dumps(asdict(self))
