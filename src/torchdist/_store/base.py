"""The ``Store`` interface: the key-value side channel by which ranks find each other.

A store maps string keys to byte values. Every rank of a job talks to the same
store; ranks publish their addresses in it, count arrivals with ``add``, and block
in ``get``/``wait`` until a peer has published what they need. Vocabulary:

- *key*: a ``str``; *value*: ``bytes`` (a ``str`` is stored as its UTF-8 bytes);
- *counter*: a key whose value is an ASCII decimal integer, created and bumped by ``add``;
- *timeout*: how long ``get``/``wait`` block for a missing key before raising
  :class:`~torchdist.errors.DistStoreError` naming the keys.

Concrete stores implement the abstract methods. As in PyTorch, the base builds
``append``, ``multi_get`` and ``multi_set`` from them, ``list_keys`` and the queues
raise ``NotImplementedError``, ``clone`` ``RuntimeError("Not implemented.")``, and
``has_extended_api()`` says whether a store implements the first three natively.
A store is a handle on sockets, files or shared state: like PyTorch's, it cannot
be pickled or copied.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Iterable

from ..errors import DistStoreError

__all__ = ["Store", "DEFAULT_STORE_TIMEOUT"]

#: PyTorch's default for every store it constructs directly.
DEFAULT_STORE_TIMEOUT = timedelta(seconds=300)


def to_bytes(value: str | bytes | bytearray | memoryview) -> bytes:
    """Values may be given as ``str`` (stored as UTF-8) or any bytes-like object."""
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, (list, tuple)):  # PyTorch accepts a list of byte values
        return bytes(value)
    raise TypeError(f"store values must be str or bytes, got {type(value).__name__}")


def key_str(key: str | bytes) -> str:
    """A key as the stores keep it. PyTorch takes ``str`` and ``bytes`` alike (both
    become a ``std::string``), so ``b"k"`` is the key ``"k"``."""
    if isinstance(key, str):
        return key
    if isinstance(key, (bytes, bytearray)):
        return bytes(key).decode("utf-8")
    raise TypeError(f"store keys must be str or bytes, got {type(key).__name__}")


def key_list(keys: list[str | bytes]) -> list[str]:
    """The keys of a many-key operation, as ``key_str``. A lone key is refused, as by
    PyTorch's binding: iterated, ``wait("ab")`` would wait for the keys "a" and "b"."""
    if isinstance(keys, (str, bytes)):
        raise TypeError(f"expected a list of keys, got the single key {keys!r}; pass [{keys!r}]")
    return [key_str(key) for key in keys]


def key_value_lists(keys: list[str | bytes], values: list[str | bytes]) -> tuple[list[str], list[bytes]]:
    """``multi_set``'s arguments as ``key_list`` and bytes; one value per key."""
    keys = key_list(keys)
    if len(keys) != len(values):
        raise ValueError(f"multi_set: got {len(keys)} keys but {len(values)} values; give one value per key")
    return keys, [to_bytes(v) for v in values]


def as_timedelta(timeout: timedelta | float | int) -> timedelta:
    """Accept a ``timedelta`` or a number of seconds."""
    if isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, (int, float)):
        return timedelta(seconds=timeout)
    raise TypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")


def wait_timeout_error(store: str, keys: Iterable[str], timeout: timedelta) -> DistStoreError:
    """The one error every store raises when keys do not appear in time."""
    ms = int(timeout.total_seconds() * 1000)
    return DistStoreError(
        f"{store}: wait timeout after {ms}ms, keys: {list(keys)}. No rank set these keys in time: "
        "check that every rank reached the same point, or raise the store's timeout."
    )


class Store:
    """Abstract base of every store; subclass it and override the operations."""

    def __init__(self, timeout: timedelta = DEFAULT_STORE_TIMEOUT) -> None:
        self._timeout = as_timedelta(timeout)

    # -- timeout -------------------------------------------------------------------
    @property
    def timeout(self) -> timedelta:
        """How long ``get`` and ``wait`` block for missing keys."""
        return self._timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = as_timedelta(timeout)

    # -- the core operations every store has ---------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        raise RuntimeError("Not implemented.")

    def get(self, key: str) -> bytes:
        raise RuntimeError("Not implemented.")

    def add(self, key: str, amount: int) -> int:
        raise RuntimeError("Not implemented.")

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        raise RuntimeError("Not implemented.")

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        raise RuntimeError("Not implemented.")

    def check(self, keys: list[str]) -> bool:
        raise RuntimeError("Not implemented.")

    def delete_key(self, key: str) -> bool:
        raise RuntimeError("Not implemented.")

    def num_keys(self) -> int:
        raise RuntimeError("Not implemented.")

    # -- the extended API ----------------------------------------------------------
    # A subclass that defines only the core operations gets these built from them, as
    # from PyTorch's C++ base class.
    def has_extended_api(self) -> bool:
        """True when ``append``, ``multi_get`` and ``multi_set`` are native operations."""
        return False

    def append(self, key: str, value: str | bytes) -> None:
        """Append ``value`` to ``key``'s value (creating it): a ``compare_set`` loop, so
        as atomic as the subclass's ``compare_set`` (``get`` would block on a missing key)."""
        suffix = to_bytes(value)
        try:  # start from what is there: a guess of b"" fails to append to a value equal to suffix
            current = self.get(key) if self.check([key]) else b""
        except RuntimeError:  # no check (or the key went away): guess empty; a missing key matches b""
            current = b""
        while True:
            desired = current + suffix
            result = self.compare_set(key, current, desired)  # desired on success, else what is there
            if result == desired:
                return
            # A present key would have matched ``current``, so getting ``current`` back
            # means the key is missing (deleted under us): start from empty.
            current = b"" if result == current else result

    def multi_get(self, keys: list[str]) -> list[bytes]:
        keys = key_list(keys)
        return [self.get(key) for key in keys]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        for key, value in zip(*key_value_lists(keys, values)):
            self.set(key, value)

    def list_keys(self) -> list[str]:
        raise NotImplementedError(f"{type(self).__name__} does not implement list_keys")

    def clone(self) -> "Store":
        raise RuntimeError("Not implemented.")

    def queue_push(self, key: str, value: str | bytes) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement queues")

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        raise NotImplementedError(f"{type(self).__name__} does not implement queues")

    def queue_len(self, key: str) -> int:
        raise NotImplementedError(f"{type(self).__name__} does not implement queues")

    def __reduce_ex__(self, protocol: int):
        # pickle, copy.copy and copy.deepcopy all come here: a copy sharing this handle's
        # socket or descriptor would close it under the original when collected.
        raise TypeError(f"cannot pickle '{type(self).__name__}' object")

    def arrive_and_wait(self, key: str, rank: int, world_size: int, timeout: timedelta | None = None) -> None:
        """Block until ranks 0..world_size-1 have all called this with ``key``.

        Each rank sets ``key/<rank>`` and waits for everyone's: only ``set`` and
        ``wait``, which every store has (a user's ``Store`` subclass often has
        nothing else, and PyTorch's init asks no more of it). Raises
        ``DistStoreError`` naming the ranks that did not arrive.
        """
        self.set(f"{key}/{rank}", b"1")
        keys = [f"{key}/{r}" for r in range(world_size)]
        try:
            self.wait(keys, timeout if timeout is not None else self.timeout)
        except DistStoreError as exc:
            try:
                missing = [r for r, k in enumerate(keys) if not self.check([k])]
            except RuntimeError:  # a store without check: the wait's error says enough
                raise exc from None
            raise DistStoreError(f"{exc} {world_size - len(missing)}/{world_size} ranks arrived at {key!r}; "
                                 f"missing: ranks {missing}.") from exc

    def barrier(self, key: str, world_size: int, timeout: timedelta | None = None) -> None:
        """Block until ``world_size`` callers have called ``barrier`` with ``key``.

        Built from ``add`` and ``wait`` so it works on every store: the last arrival
        sets ``key + "/done"``, which everyone waits for.
        """
        if world_size <= 0:
            raise ValueError(f"barrier: world_size must be positive, got {world_size}")
        if self.add(key, 1) == world_size:
            self.set(key + "/done", b"1")
        self.wait([key + "/done"], timeout if timeout is not None else self.timeout)
