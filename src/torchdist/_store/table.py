"""The semantics of a store's operations, once, on an in-memory table.

``HashStore`` (in-process) and the ``TCPStore`` server both keep their data in a
:class:`KeyValueTable`, so ``add``'s ASCII counters, ``compare_set``'s rules and the
queues behave identically whether a rank talks to a local or a remote store.

The table is not thread-safe and never blocks: callers hold their own lock (the
HashStore) or run it on one thread (the TCPStore server's event loop). Blocking
``get``/``wait`` are built on top by watching ``changed`` keys: every mutation
calls ``on_change(key)`` so the owner can wake whoever waits for that key.
"""

from __future__ import annotations

import operator
from collections import deque
from typing import Callable, Iterable

_INT64 = 1 << 64


def int64_amount(amount: object) -> int:
    """``add``'s amount: an int that fits int64, as PyTorch's binding requires (TypeError else)."""
    amount = operator.index(amount)
    if not -(1 << 63) <= amount < 1 << 63:
        raise TypeError(f"add: the amount {amount} does not fit a signed 64-bit integer")
    return amount


class KeyValueTable:
    """Keys to byte values, plus FIFO queues; one mutation notifies ``on_change``.

    Queues are a namespace of their own, as in PyTorch: ``num_keys``, ``list_keys``
    and ``delete_key`` see only keys with values; ``check``/``wait`` see both."""

    def __init__(self, on_change: Callable[[str], None] | None = None) -> None:
        self._data: dict[str, bytes] = {}
        self._queues: dict[str, deque[bytes]] = {}
        self._on_change = on_change or (lambda key: None)

    # -- reads ---------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        """The value, or None when the key is missing (the caller decides to wait)."""
        return self._data.get(key)

    def contains(self, key: str) -> bool:
        """A key exists when it holds a value or a non-empty queue."""
        return key in self._data or bool(self._queues.get(key))

    def check(self, keys: Iterable[str]) -> bool:
        return all(self.contains(key) for key in keys)

    def num_keys(self) -> int:
        return len(self._data)

    def list_keys(self) -> list[str]:
        return list(self._data)

    # -- writes --------------------------------------------------------------------
    def set(self, key: str, value: bytes) -> None:
        self._data[key] = value
        self._on_change(key)

    def add(self, key: str, amount: int) -> int:
        """Counters are stored as ASCII decimal so ``get`` returns e.g. ``b"21"``."""
        current = self._data.get(key)
        try:
            total = (int(current) if current is not None else 0) + int64_amount(amount)
        except ValueError:
            raise ValueError(
                f"add: the value of key {key!r} is {current!r}, which is not an integer counter"
            ) from None
        total = (total + (1 << 63)) % _INT64 - (1 << 63)  # int64 wraps around, as PyTorch's counters do
        self._data[key] = str(total).encode()
        self._on_change(key)
        return total

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """PyTorch's rules: swap on match (or missing key with empty ``expected``).

        On success the new value is returned; on failure the current value, or
        ``expected`` itself when the key is missing.
        """
        current = self._data.get(key)
        if current is None:
            if expected == b"":
                self._data[key] = desired
                self._on_change(key)
                return desired
            return expected
        if current == expected:
            self._data[key] = desired
            self._on_change(key)
            return desired
        return current

    def append(self, key: str, value: bytes) -> None:
        self._data[key] = self._data.get(key, b"") + value
        self._on_change(key)

    def delete(self, key: str) -> bool:
        return self._data.pop(key, None) is not None

    # -- queues --------------------------------------------------------------------
    def queue_push(self, key: str, value: bytes) -> None:
        self._queues.setdefault(key, deque()).append(value)
        self._on_change(key)

    def queue_pop(self, key: str) -> bytes | None:
        """The oldest value, or None when the queue is empty (the caller may wait)."""
        queue = self._queues.get(key)
        if not queue:
            return None
        value = queue.popleft()
        if not queue:
            del self._queues[key]
        return value

    def queue_len(self, key: str) -> int:
        return len(self._queues.get(key, ()))
