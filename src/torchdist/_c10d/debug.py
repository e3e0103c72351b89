"""The package's debug level: ``TORCH_DISTRIBUTED_DEBUG`` and ``get/set_debug_level``, as PyTorch's.

PyTorch checks collectives across ranks only at DETAIL; torchdist checks every
collective's fingerprint at every level, so the level only says how much the
``torchdist`` logger tells: INFO logs group and DDP set-up, DETAIL also every
debug line. OFF leaves the logger as the application configured it.
"""

from __future__ import annotations

import enum
import logging
import os

__all__ = ["DebugLevel", "get_debug_level", "set_debug_level", "set_debug_level_from_env"]

_ENV = "TORCH_DISTRIBUTED_DEBUG"


class DebugLevel(enum.IntEnum):
    OFF = 0
    INFO = 1
    DETAIL = 2

    __str__ = enum.Enum.__str__  # "DebugLevel.INFO", as PyTorch's enum prints


_LOGGING_LEVELS = {DebugLevel.INFO: logging.INFO, DebugLevel.DETAIL: logging.DEBUG}
_level = DebugLevel.OFF


def get_debug_level() -> DebugLevel:
    return _level


def set_debug_level(level: DebugLevel) -> None:
    """Set the debug level of the package (a ``DebugLevel``; PyTorch refuses anything else)."""
    global _level
    if not isinstance(level, DebugLevel):
        raise TypeError(f"set_debug_level(): incompatible function arguments: expected a torchdist.DebugLevel, "
                        f"got {level!r}")
    _level = level
    if level in _LOGGING_LEVELS:
        logging.getLogger("torchdist").setLevel(_LOGGING_LEVELS[level])


def set_debug_level_from_env() -> None:
    """Set the level from ``TORCH_DISTRIBUTED_DEBUG`` (OFF, INFO or DETAIL, any case; unset: OFF)."""
    value = os.environ.get(_ENV, "OFF").upper()
    if value not in DebugLevel.__members__:
        raise ValueError(f"The value of {_ENV} must be OFF, INFO, or DETAIL.")
    set_debug_level(DebugLevel[value])


set_debug_level_from_env()  # read at import, as torch.distributed does
