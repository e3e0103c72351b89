"""Event destinations by name (``--event-log-handler``): ``console``, ``null``, ``dynamic_rendezvous``."""

from __future__ import annotations

import logging

__all__ = ["get_logging_handler"]

# A mutable registry, as torch's: a program may add or replace a destination.
_log_handlers: dict[str, logging.Handler] = {
    "console": logging.StreamHandler(),
    "dynamic_rendezvous": logging.NullHandler(),
    "null": logging.NullHandler(),
}


def get_logging_handler(destination: str = "null") -> logging.Handler:
    """The handler events recorded to ``destination`` go to; KeyError for an unknown name."""
    return _log_handlers[destination]
