"""``PrefixStore``: a namespace inside another store.

Every key ``k`` becomes ``prefix + "/" + k`` in the underlying store, so that
several users (process groups, RPC, the elastic agent) share one store without
meeting each other's keys. Prefix stores nest: ``PrefixStore("a",
PrefixStore("b", s))`` stores ``k`` as ``"b/a/k"`` in ``s``.

A prefix store holds no data and no timeout of its own: ``timeout`` and
``set_timeout`` are the underlying store's, and ``wait``/``check``/``num_keys``
forward to it (``num_keys`` counts the whole underlying store, as PyTorch's
does).

``append``, ``multi_get`` and ``multi_set`` forward when the underlying store
implements them natively (``has_extended_api()``); otherwise they are emulated:
``multi_*`` key by key with ``get``/``set``, and ``append`` as a
``compare_set`` loop, which stays atomic as long as no other writer appends
exactly the same bytes at the same moment.
"""

from __future__ import annotations

from datetime import timedelta

from .base import Store, key_list, key_str, key_value_lists, to_bytes

__all__ = ["PrefixStore"]


class PrefixStore(Store):
    """``store`` seen through the key namespace ``prefix + "/"``."""

    def __init__(self, prefix: str, store: Store) -> None:
        # No Store.__init__: the timeout lives in the underlying store.
        if store is None:
            raise ValueError("PrefixStore: store argument cannot be None")
        self._prefix = key_str(prefix)
        self._store = store

    def _key(self, key: str | bytes) -> str:
        return f"{self._prefix}/{key_str(key)}"

    # -- what it wraps -------------------------------------------------------------
    @property
    def underlying_store(self) -> Store:
        """The store this one wraps (possibly another PrefixStore)."""
        return self._store

    @property
    def _underlying_non_prefix_store(self) -> Store:
        """The first store down the chain that is not a PrefixStore."""
        store = self._store
        while isinstance(store, PrefixStore):
            store = store._store
        return store

    @property
    def timeout(self) -> timedelta:
        return self._store.timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self._store.set_timeout(timeout)

    # -- core operations -----------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        # bytes to the store below, as PyTorch's C++ PrefixStore hands a Python Store subclass
        self._store.set(self._key(key), to_bytes(value))

    def get(self, key: str) -> bytes:
        return self._store.get(self._key(key))

    def add(self, key: str, amount: int) -> int:
        return self._store.add(self._key(key), amount)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._store.compare_set(self._key(key), to_bytes(expected), to_bytes(desired))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        keys = key_list(keys)
        keys = [self._key(k) for k in keys]
        if timeout is None:
            self._store.wait(keys)
        else:
            self._store.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        keys = key_list(keys)
        return self._store.check([self._key(k) for k in keys])

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(self._key(key))

    def num_keys(self) -> int:
        """The keys of the whole underlying store, not only this prefix's."""
        return self._store.num_keys()

    def list_keys(self) -> list[str]:
        """The keys under this prefix, without it."""
        head = self._prefix + "/"
        return [k[len(head) :] for k in self._store.list_keys() if k.startswith(head)]

    def clone(self) -> "PrefixStore":
        return PrefixStore(self._prefix, self._store.clone())

    # -- extended API: native, or the underlying store's emulation (base.Store) -----
    def has_extended_api(self) -> bool:
        return self._store.has_extended_api()

    def append(self, key: str, value: str | bytes) -> None:
        self._store.append(self._key(key), to_bytes(value))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        keys = key_list(keys)
        return self._store.multi_get([self._key(k) for k in keys])

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        keys, values = key_value_lists(keys, values)
        self._store.multi_set([self._key(k) for k in keys], values)

    # -- queues --------------------------------------------------------------------
    def queue_push(self, key: str, value: str | bytes) -> None:
        self._store.queue_push(self._key(key), to_bytes(value))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        return self._store.queue_pop(self._key(key), block)

    def queue_len(self, key: str) -> int:
        return self._store.queue_len(self._key(key))

    def __repr__(self) -> str:
        return f"PrefixStore({self._prefix!r}, {self._store!r})"
