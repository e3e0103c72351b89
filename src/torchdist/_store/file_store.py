"""``FileStore``: a store that processes share through one file.

(Longer than most modules: the log format, its locking and the reference
counting only make sense together, so they stay in one place.)

The file is an append-only log of operations. Every handle keeps a
:class:`~torchdist._store.table.KeyValueTable` and the offset up to which it has
replayed the log; before each operation it replays the records written since
(its "catch-up"). So the file is the truth and each table a cache of it.

File format::

    header   b"torchdist.FileStore.v1\\n"
    record   op (1 byte) | key length (u32, little endian) | key (UTF-8)
                         | value length (u32, little endian) | value

    op  S set       key := value
        A append    key := key's value + value
        D delete    key removed (value empty)
        P push      value pushed on queue key
        Q pop       oldest value of queue key removed (value empty)

``add`` and ``compare_set`` are logged as ``S`` of their result (nothing when a
``compare_set`` fails), so replaying never has to re-decide anything.

Locking. A writer takes ``flock(LOCK_EX)``, catches up, applies the operation to
its table and appends the record, all under the lock: it decides on the latest
state and nobody writes in between, so every handle replays the same history. A
reader takes ``LOCK_SH`` to catch up, so it never sees half a record. ``flock``
excludes open file descriptions, not threads, so each handle also has a
``threading.Lock``; ``clone()`` opens a new description.

Blocking ``get``/``wait``/``queue_pop`` poll: catch up, test, sleep with a
backoff from 1 ms to 20 ms. Between polls a waiter compares the file's size with
its offset and takes no lock when nothing was written.

Reference counting (PyTorch's rule). Opening adds 1 to the internal key
``refcount``; closing adds 1 to ``cleanup`` and -1 to ``refcount``. The handle
that brings ``refcount`` to 0 once ``cleanup >= world_size`` deletes the file, so
the last of ``world_size`` users to close removes it; with ``world_size=-1`` the
file is never deleted. User keys are stored as ``"/" + key`` so that they cannot
meet the internal keys, which ``num_keys`` counts as PyTorch's does (``refcount``
from the first open, ``cleanup`` from the first close) and ``list_keys`` hides.

A log that does not start with the header, or holds an unknown op or a record
cut short, raises :class:`~torchdist.errors.DistStoreError` naming the file and
the offset: a store never hangs on a file it cannot read.

The log is never compacted (nor is PyTorch's): the file grows with every write
for as long as the store lives, and a new handle replays all of it.

Unlike PyTorch's FileStore, ``append``, ``multi_get``, ``multi_set`` and the
queues are native (one locked write each), so ``has_extended_api()`` is True.
A timeout of zero means "no timeout", as in PyTorch's FileStore.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
import time
from datetime import timedelta
from typing import Callable, Iterator, TypeVar

from ..errors import DistStoreError, QueueEmptyError
from .base import (DEFAULT_STORE_TIMEOUT, Store, as_timedelta, key_list, key_str, key_value_lists, to_bytes,
                   wait_timeout_error)
from .table import KeyValueTable

__all__ = ["FileStore"]

_HEADER = b"torchdist.FileStore.v1\n"
_LENGTH = struct.Struct("<I")

_SET, _APPEND, _DELETE, _PUSH, _POP = b"S", b"A", b"D", b"P", b"Q"
_OPS = frozenset((_SET, _APPEND, _DELETE, _PUSH, _POP))

_REFCOUNT = "refcount"  # open handles
_CLEANUP = "cleanup"  # handles ever closed

_T = TypeVar("_T")

_POLL_MIN_S = 0.001
_POLL_MAX_S = 0.02


def _user(key: str | bytes) -> str:
    """The table key of a user key; internal keys never start with "/"."""
    return "/" + key_str(key)


def _deadline(timeout: timedelta) -> float | None:
    """When a wait of ``timeout`` ends, on the monotonic clock; None for no timeout."""
    return None if timeout == timedelta(0) else time.monotonic() + timeout.total_seconds()


def _record(op: bytes, key: str, value: bytes = b"") -> bytes:
    encoded = key.encode("utf-8")
    return op + _LENGTH.pack(len(encoded)) + encoded + _LENGTH.pack(len(value)) + value


class FileStore(Store):
    """A store shared by every process (and handle) that opens ``file_name``."""

    def __init__(self, file_name: str | os.PathLike, world_size: int = -1) -> None:
        super().__init__(DEFAULT_STORE_TIMEOUT)
        self.path: str = os.fspath(file_name)
        self._world_size = int(world_size)
        self._lock = threading.Lock()
        self._table = KeyValueTable()
        self._offset = 0
        self._pid = os.getpid()
        self._fd: int | None = None
        # Whether this handle holds a reference (a copy in a forked child does not).
        self._counted = False
        self._fd = self._open_live()
        try:
            if os.fstat(self._fd).st_size == 0:
                self._write(_HEADER)
            self._catch_up()
            self._write_record(_SET, _REFCOUNT, str(self._table.add(_REFCOUNT, 1)).encode())
        except BaseException as exc:
            os.close(self._fd)  # also releases the lock
            self._fd = None
            if isinstance(exc, OSError):  # opened, but not a file a store can live in (/proc/..., a full disk)
                raise DistStoreError(f"FileStore: cannot use {self.path!r}: {exc.strerror or exc}") from exc
            raise
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._counted = True

    # -- the file ------------------------------------------------------------------
    def _open(self, create: bool) -> int:
        flags = os.O_RDWR | os.O_APPEND | (os.O_CREAT if create else 0)
        try:
            return os.open(self.path, flags, 0o644)
        except OSError as exc:
            raise DistStoreError(f"FileStore: cannot open {self.path!r}: {exc.strerror}") from exc

    def _open_live(self) -> int:
        """Open (or create) the file and lock it exclusively, making sure that the
        locked file is still the one at ``path``: the last user of the previous
        store may have deleted it between our open and our lock."""
        while True:
            fd = self._open(create=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)  # also releases the lock

    @contextlib.contextmanager
    def _handle(self) -> Iterator[int]:
        """Hold this handle's thread lock; yield a descriptor usable in this process."""
        with self._lock:
            if self._fd is None:
                raise DistStoreError(f"FileStore {self.path!r}: the store was closed")
            if self._pid != os.getpid():
                # A copy inherited through fork() shares the parent's open file
                # description, hence its flock: reopen to get a lock of our own.
                # The reference stays the parent's.
                os.close(self._fd)
                self._fd = None
                self._fd = self._open(create=False)
                self._pid, self._counted = os.getpid(), False
            yield self._fd

    @contextlib.contextmanager
    def _flock(self, fd: int, exclusive: bool) -> Iterator[None]:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        """Hold the thread lock and the file lock for one operation."""
        with self._handle() as fd, self._flock(fd, exclusive):
            yield

    def _write(self, data: bytes) -> None:
        """Append ``data``; the caller holds the exclusive lock."""
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def _write_record(self, op: bytes, key: str, value: bytes = b"") -> None:
        """Log an operation already applied to our table; we are caught up, so our
        offset moves past our own record without re-reading it."""
        record = _record(op, key, value)
        self._write(record)
        self._offset += len(record)

    def _catch_up(self) -> None:
        """Replay the records written since our offset; the caller holds a file lock."""
        size = os.fstat(self._fd).st_size
        if size == self._offset:
            return
        if size < self._offset:
            raise self._corrupt(size, f"the file shrank from {self._offset} to {size} bytes")
        data = os.pread(self._fd, size - self._offset, self._offset)
        pos = 0
        if self._offset == 0:
            if not data.startswith(_HEADER):
                raise self._corrupt(0, "it does not start with the FileStore header")
            pos = len(_HEADER)
        while pos < len(data):
            start = pos
            op = data[pos : pos + 1]
            if op not in _OPS:
                raise self._corrupt(self._offset + start, f"unknown record type {op!r}")
            key, pos = self._field(data, pos + 1, start)
            value, pos = self._field(data, pos, start)
            self._apply(op, key.decode("utf-8", "surrogateescape"), value)
        self._offset += len(data)

    def _field(self, data: bytes, pos: int, start: int) -> tuple[bytes, int]:
        """One length-prefixed field of the record that begins at ``start``."""
        end = pos + _LENGTH.size
        if end > len(data):
            raise self._corrupt(self._offset + start, "a record is cut short")
        (length,) = _LENGTH.unpack_from(data, pos)
        if end + length > len(data):
            raise self._corrupt(
                self._offset + start,
                f"a record is cut short (a field of {length} bytes, {len(data) - end} left)",
            )
        return data[end : end + length], end + length

    def _apply(self, op: bytes, key: str, value: bytes) -> None:
        if op == _SET:
            self._table.set(key, value)
        elif op == _APPEND:
            self._table.append(key, value)
        elif op == _DELETE:
            self._table.delete(key)
        elif op == _PUSH:
            self._table.queue_push(key, value)
        else:  # _POP
            self._table.queue_pop(key)

    def _corrupt(self, offset: int, what: str) -> DistStoreError:
        return DistStoreError(
            f"FileStore {self.path!r}: the file is not a valid store log at byte {offset}: "
            f"{what}. Was it truncated, or written by something other than torchdist's "
            "FileStore? Use a fresh file."
        )

    def _query(self, probe: Callable[[KeyValueTable], _T]) -> _T:
        """``probe`` of the caught-up table. The file lock is taken only when the
        file has grown: a size equal to our offset means nothing new to read."""
        with self._handle() as fd:
            if os.fstat(fd).st_size != self._offset:
                with self._flock(fd, exclusive=False):
                    self._catch_up()
            return probe(self._table)

    def _poll(
        self,
        probe: Callable[[KeyValueTable], _T | None],
        keys: list[str],
        timeout: timedelta,
        deadline: float | None = None,
    ) -> _T:
        """The first non-None ``probe`` of the table, polling with a backoff until
        ``deadline`` (by default ``timeout`` from now; a zero timeout waits forever,
        as in PyTorch's FileStore)."""
        if deadline is None:
            deadline = _deadline(timeout)
        delay = _POLL_MIN_S
        while (result := self._query(probe)) is None:
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise wait_timeout_error("FileStore", keys, timeout)
                time.sleep(min(delay, remaining))
            else:
                time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
        return result

    # -- core operations -----------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        key, value = _user(key), to_bytes(value)
        with self._locked(exclusive=True):
            self._catch_up()
            self._table.set(key, value)
            self._write_record(_SET, key, value)

    def get(self, key: str) -> bytes:
        user = _user(key)
        return self._poll(lambda t: t.get(user), [key], self.timeout)

    def add(self, key: str, amount: int) -> int:
        key = _user(key)
        with self._locked(exclusive=True):
            self._catch_up()
            total = self._table.add(key, amount)
            self._write_record(_SET, key, str(total).encode())
        return total

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        key, desired = _user(key), to_bytes(desired)
        with self._locked(exclusive=True):
            self._catch_up()
            current, expected = self._table.get(key), to_bytes(expected)
            result = self._table.compare_set(key, expected, desired)
            swapped = current == expected if current is not None else expected == b""
            if swapped:
                self._write_record(_SET, key, desired)
        return result

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        keys = key_list(keys)
        timeout = self.timeout if timeout is None else as_timedelta(timeout)
        users = [_user(k) for k in keys]
        self._poll(lambda t: t.check(users) or None, keys, timeout)

    def check(self, keys: list[str]) -> bool:
        keys = key_list(keys)
        users = [_user(k) for k in keys]
        return self._query(lambda t: t.check(users))

    def delete_key(self, key: str) -> bool:
        key = _user(key)
        with self._locked(exclusive=True):
            self._catch_up()
            existed = self._table.delete(key)
            if existed:
                self._write_record(_DELETE, key)
        return existed

    def num_keys(self) -> int:
        """User keys plus the internal ``refcount`` (and ``cleanup``), as PyTorch counts."""
        return self._query(KeyValueTable.num_keys)

    def list_keys(self) -> list[str]:
        """User keys only."""
        keys = self._query(KeyValueTable.list_keys)
        return [k[1:] for k in keys if k.startswith("/")]

    def clone(self) -> "FileStore":
        """A new handle on the same file (it holds a reference of its own)."""
        store = FileStore(self.path, self._world_size)
        store.set_timeout(self.timeout)
        return store

    # -- extended API --------------------------------------------------------------
    def has_extended_api(self) -> bool:
        return True

    def append(self, key: str, value: str | bytes) -> None:
        key, value = _user(key), to_bytes(value)
        with self._locked(exclusive=True):
            self._catch_up()
            self._table.append(key, value)
            self._write_record(_APPEND, key, value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Every value, in order; blocks (up to the timeout) until all keys exist."""
        keys = key_list(keys)
        users = [_user(k) for k in keys]

        def probe(table: KeyValueTable) -> list[bytes] | None:
            values = [table.get(u) for u in users]
            return None if None in values else values

        return self._poll(probe, keys, self.timeout)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        """Set every key in one write: a reader sees all of them or none."""
        keys, values = key_value_lists(keys, values)
        users = [_user(k) for k in keys]
        with self._locked(exclusive=True):
            self._catch_up()
            for key, value in zip(users, values):
                self._table.set(key, value)
            records = b"".join(_record(_SET, k, v) for k, v in zip(users, values))
            self._write(records)
            self._offset += len(records)

    # -- queues --------------------------------------------------------------------
    def queue_push(self, key: str, value: str | bytes) -> None:
        key, value = _user(key), to_bytes(value)
        with self._locked(exclusive=True):
            self._catch_up()
            self._table.queue_push(key, value)
            self._write_record(_PUSH, key, value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """The oldest value of the queue; blocks up to the timeout unless ``block=False``."""
        user = _user(key)
        deadline = _deadline(self.timeout)
        while True:
            with self._locked(exclusive=True):
                self._catch_up()
                value = self._table.queue_pop(user)
                if value is not None:
                    self._write_record(_POP, user)
                    return value
            if not block:
                raise QueueEmptyError(f"FileStore: queue_pop(block=False): queue {key!r} is empty")
            # Wait for a push; another handle may still pop it first, so try again.
            self._poll(lambda t: t.queue_len(user) > 0 or None, [key], self.timeout, deadline)

    def queue_len(self, key: str) -> int:
        user = _user(key)
        return self._query(lambda t: t.queue_len(user))

    # -- life cycle ----------------------------------------------------------------
    def close(self) -> None:
        """Give back this handle's reference; the last of ``world_size`` users deletes the file.

        Idempotent. Operations on a closed handle raise DistStoreError. If the log
        has become unreadable, the release cannot be recorded: the handle is
        closed all the same and the DistStoreError is raised.
        """
        with self._lock:
            fd = self._fd
            if fd is None:
                return
            try:
                if self._counted and self._pid == os.getpid():
                    self._release(fd)
            finally:
                self._fd = None
                os.close(fd)

    def _release(self, fd: int) -> None:
        """Record this handle's close; delete the file if it was the last use."""
        with self._flock(fd, exclusive=True):
            self._catch_up()
            finished = self._table.add(_CLEANUP, 1)
            self._write_record(_SET, _CLEANUP, str(finished).encode())
            refcount = self._table.add(_REFCOUNT, -1)
            self._write_record(_SET, _REFCOUNT, str(refcount).encode())
            if refcount == 0 and self._world_size >= 0 and finished >= self._world_size:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)

    def __enter__(self) -> "FileStore":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        # A finalizer cannot report failures usefully (it may even run at
        # interpreter exit, with modules half torn down); close() is the way to
        # see them.
        with contextlib.suppress(Exception):
            self.close()

    def __repr__(self) -> str:
        return f"FileStore(path={self.path!r}, world_size={self._world_size})"
