"""The behaviour every store must show: one set of tests, run against each store.

Use it by subclassing :class:`StoreConformance` in a test module, under a name
that starts with ``Test``, and defining ``make_store``::

    class TestHashStoreConformance(StoreConformance):
        def make_store(self, tmp_path):
            return HashStore()

pytest then runs every ``test_*`` method below against that store. Class
attributes describe what differs between stores on purpose:

- ``internal_keys``: how many keys ``num_keys`` counts in a fresh store beyond the
  user's (PyTorch's TCPStore and FileStore count one of their own);
- ``has_queues``: whether ``queue_push``/``queue_pop``/``queue_len`` are supported.

Each test gets a fresh store with a 10 s timeout, long enough that a wait
released by another thread never times out by accident; the tests about
timeouts set a short one themselves. Other threads use ``clone()`` handles, as
PyTorch recommends. The statements tested are those of section 2.1 of the
PyTorch inventory (add, set/get, timeouts, compare_set, check, delete_key,
num_keys, append, multi_*, queues, clone).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator

import pytest

from torchdist.errors import DistError, DistStoreError, QueueEmptyError
from torchdist._store.base import Store

__all__ = ["StoreConformance", "run_threads"]

LONG = timedelta(seconds=10)  # a wait that must not time out
SHORT = timedelta(milliseconds=100)  # a wait that must time out
RELEASE_DELAY_S = 0.05  # how long a releasing thread waits before writing


def run_threads(*fns: Callable[[], object], timeout: float = 10.0) -> list[object]:
    """Run each function on its own thread; return their results, re-raise the first error."""
    results: list[object] = [None] * len(fns)
    errors: list[BaseException] = []

    def body(i: int, fn: Callable[[], object]) -> None:
        try:
            results[i] = fn()
        except BaseException as exc:  # re-raised in the test's thread below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        if thread.is_alive():
            raise AssertionError(f"a thread did not finish within {timeout} s")
    if errors:
        raise errors[0]
    return results


def later(fn: Callable[[], object], delay: float = RELEASE_DELAY_S) -> Callable[[], object]:
    """``fn`` after a short sleep: the writer that releases a waiter."""

    def delayed() -> object:
        time.sleep(delay)
        return fn()

    return delayed


class StoreConformance:
    """The tests; subclasses say how to make the store (see the module docstring)."""

    internal_keys: int = 0
    has_queues: bool = True

    def make_store(self, tmp_path: Path) -> Store:
        """A fresh, empty store; ``tmp_path`` is this test's scratch directory."""
        raise NotImplementedError(f"{type(self).__name__} must define make_store")

    def close_store(self, store: Store) -> None:
        """Release a handle: ``close()`` it, or the first store under it that has one."""
        while store is not None:
            close = getattr(store, "close", None)
            if close is not None:
                close()
                return
            store = getattr(store, "underlying_store", None)

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[Store]:
        store = self.make_store(tmp_path)
        store.set_timeout(LONG)
        yield store
        self.close_store(store)

    @pytest.fixture
    def clone(self, store: Store) -> Iterator[Callable[[], Store]]:
        """Make clones of ``store`` that are closed after the test."""
        clones: list[Store] = []

        def make() -> Store:
            clones.append(store.clone())
            return clones[-1]

        yield make
        for c in clones:
            self.close_store(c)

    def _needs_queues(self) -> None:
        if not self.has_queues:
            pytest.skip("this store has no queues")

    # -- set / get -----------------------------------------------------------------
    def test_set_then_get_returns_bytes(self, store: Store) -> None:
        store.set("key", "value")
        store.set("raw", b"\x00\xff\x01")
        assert store.get("key") == b"value"
        assert store.get("raw") == b"\x00\xff\x01"

    def test_set_overwrites(self, store: Store) -> None:
        store.set("key", "one")
        store.set("key", "two")
        assert store.get("key") == b"two"

    def test_empty_value_is_a_value(self, store: Store) -> None:
        store.set("empty", b"")
        assert store.get("empty") == b""
        assert store.check(["empty"])

    def test_keys_with_slashes_and_unicode(self, store: Store) -> None:
        store.set("a/b/c", "1")
        store.set("ключ", "2")
        assert store.get("a/b/c") == b"1"
        assert store.get("ключ") == b"2"

    # -- add -----------------------------------------------------------------------
    def test_add_accumulates_as_ascii_decimal(self, store: Store) -> None:
        totals = [store.add("counter", i) for i in range(1, 7)]
        assert totals == [1, 3, 6, 10, 15, 21]
        assert store.get("counter") == b"21"

    def test_add_negative_and_zero(self, store: Store) -> None:
        assert store.add("n", -3) == -3
        assert store.add("n", 0) == -3
        assert store.get("n") == b"-3"

    def test_add_continues_a_value_set_as_digits(self, store: Store) -> None:
        store.set("n", "40")
        assert store.add("n", 2) == 42

    def test_add_to_non_integer_raises_value_error(self, store: Store) -> None:
        store.set("text", "abc")
        with pytest.raises(ValueError):
            store.add("text", 1)
        assert store.get("text") == b"abc"

    def test_add_wraps_around_int64_and_takes_int_amounts_only(self, store: Store) -> None:
        """As PyTorch's int64 counters: the sum wraps around; a float or an amount past int64 is a TypeError."""
        assert store.add("big", 1 << 62) == 1 << 62
        assert store.add("big", 1 << 62) == -(1 << 63)
        for amount in (1.5, 1 << 64):
            with pytest.raises(TypeError):
                store.add("big", amount)
        assert store.add("big", 1) == -(1 << 63) + 1

    # -- timeouts ------------------------------------------------------------------
    def test_timeout_property_and_set_timeout(self, store: Store) -> None:
        assert store.timeout == LONG
        store.set_timeout(timedelta(seconds=3))
        assert store.timeout == timedelta(seconds=3)

    def test_get_missing_key_times_out(self, store: Store) -> None:
        store.set_timeout(SHORT)
        start = time.monotonic()
        with pytest.raises(DistStoreError, match="[Tt]imeout") as info:
            store.get("missing")
        assert time.monotonic() - start >= SHORT.total_seconds() * 0.9
        assert isinstance(info.value, DistError) and isinstance(info.value, RuntimeError)

    def test_store_is_usable_after_a_timeout(self, store: Store) -> None:
        store.set_timeout(SHORT)
        with pytest.raises(DistStoreError):
            store.get("late")
        store.set("late", "here")
        assert store.get("late") == b"here"

    def test_wait_missing_key_times_out_after_given_timeout(self, store: Store) -> None:
        start = time.monotonic()
        with pytest.raises(DistStoreError, match="[Tt]imeout"):
            store.wait(["missing"], SHORT)
        elapsed = time.monotonic() - start
        assert SHORT.total_seconds() * 0.9 <= elapsed < LONG.total_seconds() / 2

    def test_wait_without_timeout_uses_store_timeout(self, store: Store) -> None:
        store.set_timeout(SHORT)
        with pytest.raises(DistStoreError, match="[Tt]imeout"):
            store.wait(["missing"])

    def test_wait_on_present_or_no_keys_returns_at_once(self, store: Store) -> None:
        store.set("a", "1")
        start = time.monotonic()
        store.wait(["a"], SHORT)
        store.wait([], SHORT)
        assert time.monotonic() - start < SHORT.total_seconds()

    # -- released by another thread ------------------------------------------------
    def test_wait_released_by_another_thread(self, store: Store, clone) -> None:
        other = clone()
        start = time.monotonic()
        run_threads(
            lambda: store.wait(["k1", "k2"]),
            later(lambda: (other.set("k1", "1"), other.set("k2", "2"))),
        )
        assert time.monotonic() - start < LONG.total_seconds() / 2

    def test_get_released_by_another_thread(self, store: Store, clone) -> None:
        other = clone()
        got, _ = run_threads(lambda: store.get("k"), later(lambda: other.set("k", "v")))
        assert got == b"v"

    # -- compare_set ---------------------------------------------------------------
    def test_compare_set_missing_key_with_expected_returns_expected(self, store: Store) -> None:
        assert store.compare_set("k", "expected", "desired") == b"expected"
        assert not store.check(["k"])

    def test_compare_set_missing_key_with_empty_expected_creates(self, store: Store) -> None:
        assert store.compare_set("k", "", "desired") == b"desired"
        assert store.get("k") == b"desired"

    def test_compare_set_wrong_expected_returns_current(self, store: Store) -> None:
        store.set("k", "current")
        assert store.compare_set("k", "wrong", "desired") == b"current"
        assert store.get("k") == b"current"

    def test_compare_set_right_expected_swaps(self, store: Store) -> None:
        store.set("k", "current")
        assert store.compare_set("k", "current", "desired") == b"desired"
        assert store.get("k") == b"desired"

    # -- check, delete_key, num_keys, list_keys ------------------------------------
    def test_check_is_true_only_when_every_key_exists(self, store: Store) -> None:
        store.set("a", "1")
        assert store.check(["a"])
        assert not store.check(["a", "b"])
        assert store.check([])

    def test_delete_key(self, store: Store) -> None:
        store.set("a", "1")
        store.set("b", "2")
        before = store.num_keys()
        assert store.delete_key("a") is True
        assert store.delete_key("a") is False
        assert store.num_keys() == before - 1
        assert not store.check(["a"])
        store.set_timeout(SHORT)
        with pytest.raises(DistStoreError):
            store.get("a")
        assert store.get("b") == b"2"

    def test_num_keys_counts_user_keys_plus_internal(self, store: Store) -> None:
        assert store.num_keys() == self.internal_keys
        store.set("a", "1")
        store.add("b", 1)
        store.set("a", "2")
        assert store.num_keys() == self.internal_keys + 2

    def test_list_keys(self, store: Store) -> None:
        store.set("a", "1")
        store.add("b", 1)
        assert {"a", "b"} <= set(store.list_keys())

    def test_bytes_keys_are_the_same_keys_as_str_ones(self, store: Store) -> None:
        store.set(b"k", "v")  # PyTorch takes both: each becomes the same std::string
        assert store.get("k") == b"v" and store.check([b"k", "k"]) and store.add(b"n", 2) == 2
        assert store.get(b"n") == b"2" and store.compare_set(b"k", "v", "w") == b"w"
        store.wait([b"k"], SHORT)
        with pytest.raises(TypeError):
            store.set(None, "v")

    def test_a_single_key_where_a_list_is_due_raises_type_error(self, store: Store) -> None:
        store.set("ab", "v")
        for call in (lambda: store.check("ab"), lambda: store.wait("a"), lambda: store.multi_get("ab"),
                     lambda: store.multi_set("ab", ["x", "y"])):
            with pytest.raises(TypeError, match="expected a list of keys"):  # as PyTorch's binding
                call()
        assert not store.check(["a"]) and not store.check(["b"])  # nothing was written key by key

    def test_a_store_cannot_be_pickled_or_copied(self, store: Store) -> None:
        import copy
        import pickle
        for duplicate in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match="cannot pickle"):  # as PyTorch's stores
                duplicate(store)
        store.set("still", "usable")  # a copy that shared its handle would have closed it
        assert store.get("still") == b"usable"

    # -- extended API --------------------------------------------------------------
    def test_has_extended_api_is_a_bool(self, store: Store) -> None:
        assert isinstance(store.has_extended_api(), bool)

    def test_append_creates_then_extends(self, store: Store) -> None:
        store.append("log", "ab")
        store.append("log", b"cd")
        assert store.get("log") == b"abcd"

    def test_append_to_a_value_equal_to_the_suffix(self, store: Store) -> None:
        store.set("x", "x")
        store.append("x", "x")
        assert store.get("x") == b"xx"

    def test_multi_set_then_multi_get_in_list_order(self, store: Store) -> None:
        store.multi_set(["b", "a", "c"], ["2", b"1", "3"])
        assert store.multi_get(["c", "a", "b"]) == [b"3", b"1", b"2"]
        assert store.get("a") == b"1"

    def test_multi_set_length_mismatch_raises_value_error(self, store: Store) -> None:
        with pytest.raises(ValueError, match="multi_set: got 2 keys but 1 values"):
            store.multi_set(["a", "b"], ["1"])
        assert not store.check(["a"])  # nothing was set

    def test_multi_get_waits_for_missing_keys(self, store: Store) -> None:
        store.set("a", "1")
        store.set_timeout(SHORT)
        with pytest.raises(DistStoreError, match="[Tt]imeout"):
            store.multi_get(["a", "missing"])

    # -- queues --------------------------------------------------------------------
    def test_queue_is_fifo_and_tracks_length(self, store: Store) -> None:
        self._needs_queues()
        assert store.queue_len("q") == 0
        for value in ("1", "2", "3"):
            store.queue_push("q", value)
        assert store.queue_len("q") == 3
        assert [store.queue_pop("q") for _ in range(3)] == [b"1", b"2", b"3"]
        assert store.queue_len("q") == 0

    def test_queue_pop_nonblocking_on_empty_raises_queue_empty(self, store: Store) -> None:
        self._needs_queues()
        with pytest.raises(QueueEmptyError, match="empty"):
            store.queue_pop("q", block=False)
        store.queue_push("q", "v")
        assert store.queue_pop("q", block=False) == b"v"

    def test_queue_pop_blocking_times_out(self, store: Store) -> None:
        self._needs_queues()
        store.set_timeout(SHORT)
        with pytest.raises(DistStoreError, match="[Tt]imeout") as info:
            store.queue_pop("q")
        assert not isinstance(info.value, QueueEmptyError)

    def test_pushed_queue_key_is_seen_by_check_and_wait(self, store: Store) -> None:
        self._needs_queues()
        assert not store.check(["q"])
        store.queue_push("q", "v")
        assert store.check(["q"])
        store.wait(["q"], SHORT)

    def test_queues_are_a_namespace_of_their_own(self, store: Store) -> None:
        """As in PyTorch: a queue is not counted, listed or deleted as a key."""
        self._needs_queues()
        before = store.num_keys()
        store.queue_push("q", "1")
        assert store.num_keys() == before
        assert store.delete_key("q") is False and store.queue_len("q") == 1
        store.set("k", "v")
        store.queue_push("k", "2")
        assert store.num_keys() == before + 1
        assert store.list_keys().count("k") == 1 and "q" not in store.list_keys()

    def test_queue_pop_released_by_push_from_another_thread(self, store: Store, clone) -> None:
        self._needs_queues()
        other = clone()
        got, _ = run_threads(lambda: store.queue_pop("q"), later(lambda: other.queue_push("q", "v")))
        assert got == b"v"

    def test_two_clones_hold_a_queue_conversation(self, store: Store, clone) -> None:
        self._needs_queues()
        a, b = clone(), clone()
        rounds = 10

        def ping() -> list[bytes]:
            replies = []
            for i in range(rounds):
                a.queue_push("to_b", str(i))
                replies.append(a.queue_pop("to_a"))
            return replies

        def pong() -> None:
            for _ in range(rounds):
                b.queue_push("to_a", b"re:" + b.queue_pop("to_b"))

        replies, _ = run_threads(ping, pong)
        assert replies == [f"re:{i}".encode() for i in range(rounds)]

    # -- clone, concurrency, barrier -----------------------------------------------
    def test_clone_sees_the_same_data_both_ways(self, store: Store, clone) -> None:
        other = clone()
        assert isinstance(other, Store)
        store.set("from_original", "1")
        other.set("from_clone", "2")
        assert other.get("from_original") == b"1"
        assert store.get("from_clone") == b"2"

    def test_concurrent_adds_from_threads_are_exact(self, store: Store, clone) -> None:
        threads, adds = 4, 50
        handles = [clone() for _ in range(threads)]
        results = run_threads(*[lambda h=h: [h.add("n", 1) for _ in range(adds)] for h in handles])
        assert store.get("n") == str(threads * adds).encode()
        # Every intermediate total was handed out exactly once.
        assert sorted(v for r in results for v in r) == list(range(1, threads * adds + 1))

    def test_concurrent_compare_set_has_one_winner(self, store: Store, clone) -> None:
        handles = [clone() for _ in range(4)]
        results = run_threads(
            *[lambda h=h, i=i: h.compare_set("leader", "", str(i)) for i, h in enumerate(handles)]
        )
        winner = store.get("leader")
        assert all(r == winner for r in results)

    def test_barrier_releases_all_threads(self, store: Store, clone) -> None:
        handles = [clone() for _ in range(3)]
        run_threads(*[lambda h=h: h.barrier("b", 3, LONG) for h in handles])
        assert store.get("b") == b"3"
