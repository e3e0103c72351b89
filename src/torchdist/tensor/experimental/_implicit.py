"""``implicit_replication()``: inside it, plain tensors mixed with DTensors count as replicated DTensors."""

from __future__ import annotations

import contextlib
from typing import Iterator

from .._dispatch import set_implicit_replication

__all__ = ["implicit_replication"]


@contextlib.contextmanager
def implicit_replication() -> Iterator[None]:
    """Let ops mix DTensors with plain tensors, taking each plain tensor as the same whole tensor on every rank."""
    previous = set_implicit_replication(True)
    try:
        yield
    finally:
        set_implicit_replication(previous)
