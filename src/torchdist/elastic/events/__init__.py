"""Events of an elastic job, through the standard ``logging`` module (torch.distributed.elastic.events).

``record(event, destination)`` logs ``event.serialize()`` on a logger of its own per
destination (``torchelastic-events-<destination>``, not propagated to the root logger)
whose handler is ``get_logging_handler(destination)``. The agent records a
``torchelastic.worker.status.<STATE>`` event per worker when a run ends, and the
rendezvous records :class:`RdzvEvent`\\s to ``dynamic_rendezvous`` (a NullHandler
unless a program installs another).
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
import traceback

from .api import Event, EventMetadataValue, EventSource, NodeState, RdzvEvent
from .handlers import get_logging_handler

__all__ = ["Event", "EventMetadataValue", "EventSource", "NodeState", "RdzvEvent", "construct_and_record_rdzv_event",
           "get_logging_handler", "record", "record_rdzv_event"]

_events_loggers: dict[str, logging.Logger] = {}


def _get_or_create_logger(destination: str = "null") -> logging.Logger:
    """The non-propagating logger of ``destination`` (made once), so that each event is handled once."""
    if destination not in _events_loggers:
        logger = logging.getLogger(f"torchelastic-events-{destination}")
        logger.setLevel(os.environ.get("LOGLEVEL", "INFO"))
        logger.propagate = False
        logger.addHandler(get_logging_handler(destination))
        _events_loggers[destination] = logger
    return _events_loggers[destination]


def record(event: Event, destination: str = "null") -> None:
    """Log ``event`` (as JSON) to ``destination``."""
    _get_or_create_logger(destination).info(event.serialize())


def record_rdzv_event(event: RdzvEvent) -> None:
    """Log a rendezvous event to the ``dynamic_rendezvous`` destination."""
    _get_or_create_logger("dynamic_rendezvous").info(event.serialize())


def construct_and_record_rdzv_event(run_id: str, message: str, node_state: NodeState, name: str = "",
                                    hostname: str = "", pid: int | None = None, master_endpoint: str = "",
                                    local_id: int | None = None, rank: int | None = None) -> None:
    """Build a :class:`RdzvEvent` named ``<caller's file>:<name or caller's function>`` and record it;
    free when the destination is a NullHandler (the default)."""
    if isinstance(get_logging_handler("dynamic_rendezvous"), logging.NullHandler):
        return
    caller = inspect.stack()[1] if len(inspect.stack()) > 1 else None
    filename = os.path.basename(caller.filename) if caller else "no_file"
    name = name or (caller.function if caller else "")
    del caller  # a frame kept alive would hold its locals
    record_rdzv_event(RdzvEvent(
        name=f"{filename}:{name}", run_id=run_id, message=message, hostname=hostname or socket.getfqdn(),
        pid=pid or os.getpid(), node_state=node_state, master_endpoint=master_endpoint, rank=rank,
        local_id=local_id, error_trace=traceback.format_exc() if node_state == NodeState.FAILED else "",
    ))
