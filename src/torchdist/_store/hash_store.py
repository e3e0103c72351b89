"""``HashStore``: an in-process, thread-safe store.

All the semantics live in :class:`~torchdist._store.table.KeyValueTable`; this
module only adds blocking. The table sits under one ``threading.Condition``:
every operation holds it, every mutation notifies it (through the table's
``on_change`` hook), and a blocked ``get``/``wait``/``queue_pop`` sleeps on it
until its predicate holds or its deadline passes.

``clone()`` returns a new handle on the same table and condition, so that
clones see each other's writes and wake each other's waiters; each handle has
its own timeout.

As in PyTorch's HashStore, a timeout of zero means "no timeout": ``get`` and
``wait`` then block until the keys appear. (PyTorch's TCPStore differs: there
zero means "do not wait".)
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Callable

from ..errors import QueueEmptyError
from .base import (DEFAULT_STORE_TIMEOUT, Store, as_timedelta, key_list, key_str, key_value_lists, to_bytes,
                   wait_timeout_error)
from .table import KeyValueTable

__all__ = ["HashStore"]


class _Shared:
    """What clones of one HashStore share: the table and the condition guarding it."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        # on_change runs inside a mutation, so the condition is already held.
        self.table = KeyValueTable(on_change=lambda key: self.cond.notify_all())


class HashStore(Store):
    """A store held in this process's memory; safe to share between threads."""

    def __init__(self) -> None:
        super().__init__(DEFAULT_STORE_TIMEOUT)
        self._shared = _Shared()

    @classmethod
    def _sharing(cls, shared: _Shared, timeout: timedelta) -> "HashStore":
        store = cls.__new__(cls)
        Store.__init__(store, timeout)
        store._shared = shared
        return store

    # -- blocking ------------------------------------------------------------------
    def _wait_until(
        self, ready: Callable[[KeyValueTable], bool], keys: list[str], timeout: timedelta
    ) -> None:
        """Sleep on the condition until ``ready(table)``; the caller holds the condition."""
        table, cond = self._shared.table, self._shared.cond
        deadline = None if timeout == timedelta(0) else time.monotonic() + timeout.total_seconds()
        while not ready(table):
            if deadline is None:
                cond.wait()
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise wait_timeout_error("HashStore", keys, timeout)
            cond.wait(remaining)

    # -- core operations -----------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        key = key_str(key)
        with self._shared.cond:
            self._shared.table.set(key, to_bytes(value))

    def get(self, key: str) -> bytes:
        key = key_str(key)
        with self._shared.cond:
            self._wait_until(lambda t: t.get(key) is not None, [key], self.timeout)
            return self._shared.table.get(key)

    def add(self, key: str, amount: int) -> int:
        key = key_str(key)
        with self._shared.cond:
            return self._shared.table.add(key, amount)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        key = key_str(key)
        with self._shared.cond:
            return self._shared.table.compare_set(key, to_bytes(expected), to_bytes(desired))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        keys = key_list(keys)
        timeout = self.timeout if timeout is None else as_timedelta(timeout)
        with self._shared.cond:
            self._wait_until(lambda t: t.check(keys), keys, timeout)

    def check(self, keys: list[str]) -> bool:
        keys = key_list(keys)
        with self._shared.cond:
            return self._shared.table.check(keys)

    def delete_key(self, key: str) -> bool:
        key = key_str(key)
        with self._shared.cond:
            return self._shared.table.delete(key)

    def num_keys(self) -> int:
        with self._shared.cond:
            return self._shared.table.num_keys()

    def list_keys(self) -> list[str]:
        with self._shared.cond:
            return self._shared.table.list_keys()

    def clone(self) -> "HashStore":
        """A new handle on the same data, with its own timeout (initially this one's)."""
        return HashStore._sharing(self._shared, self.timeout)

    # -- extended API --------------------------------------------------------------
    def has_extended_api(self) -> bool:
        return True

    def append(self, key: str, value: str | bytes) -> None:
        key = key_str(key)
        with self._shared.cond:
            self._shared.table.append(key, to_bytes(value))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Every value, in order; blocks (up to the timeout) until all keys exist."""
        keys = key_list(keys)
        with self._shared.cond:
            self._wait_until(lambda t: all(t.get(k) is not None for k in keys), keys, self.timeout)
            return [self._shared.table.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        """Set every key at once: a waiter never sees some of them without the others."""
        keys, values = key_value_lists(keys, values)
        with self._shared.cond:
            for key, value in zip(keys, values):
                self._shared.table.set(key, value)

    # -- queues --------------------------------------------------------------------
    def queue_push(self, key: str, value: str | bytes) -> None:
        key = key_str(key)
        with self._shared.cond:
            self._shared.table.queue_push(key, to_bytes(value))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """The oldest value of the queue; blocks up to the timeout unless ``block=False``."""
        key = key_str(key)
        with self._shared.cond:
            if not block and self._shared.table.queue_len(key) == 0:
                raise QueueEmptyError(f"HashStore: queue_pop(block=False): queue {key!r} is empty")
            self._wait_until(lambda t: t.queue_len(key) > 0, [key], self.timeout)
            return self._shared.table.queue_pop(key)

    def queue_len(self, key: str) -> int:
        key = key_str(key)
        with self._shared.cond:
            return self._shared.table.queue_len(key)
