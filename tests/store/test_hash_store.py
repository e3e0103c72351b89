"""HashStore: the conformance suite, plus what only an in-process store shows.

Threads stand in for ranks here: many waiters released by one write, many
writers whose adds must all count, and parity with PyTorch's HashStore on
the results of a fixed sequence of operations.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from torchdist._store.hash_store import HashStore
from torchdist.errors import DistStoreError

from .conformance import LONG, StoreConformance, later, run_threads


class TestHashStoreConformance(StoreConformance):
    def make_store(self, tmp_path: Path) -> HashStore:
        return HashStore()


def test_has_extended_api() -> None:
    assert HashStore().has_extended_api() is True


def test_default_timeout_is_pytorchs() -> None:
    assert HashStore().timeout == timedelta(seconds=300)


def test_many_waiters_released_by_one_write() -> None:
    store = HashStore()
    store.set_timeout(LONG)
    waiters = [lambda: store.wait(["go"]) for _ in range(8)]
    getters = [lambda: store.get("go") for _ in range(8)]
    results = run_threads(*waiters, *getters, later(lambda: store.set("go", "now")))
    assert results[8:16] == [b"now"] * 8


def test_concurrent_adds_on_one_handle_are_exact() -> None:
    store = HashStore()
    threads, adds = 8, 500
    run_threads(*[lambda: [store.add("n", 1) for _ in range(adds)] for _ in range(threads)])
    assert store.get("n") == str(threads * adds).encode()


def test_concurrent_appends_keep_every_piece() -> None:
    store = HashStore()
    run_threads(*[lambda c=c: [store.append("log", c) for _ in range(100)] for c in "abcd"])
    value = store.get("log")
    assert len(value) == 400 and all(value.count(c.encode()) == 100 for c in "abcd")


def test_multi_set_is_seen_all_at_once() -> None:
    store = HashStore()
    store.set_timeout(LONG)
    seen: list[list[bytes]] = []

    def watcher() -> None:
        store.wait(["a"])
        seen.append([store.check(["b"]), store.check(["c"])])

    run_threads(watcher, later(lambda: store.multi_set(["a", "b", "c"], ["1", "2", "3"])))
    assert seen == [[True, True]]


def test_clone_has_its_own_timeout() -> None:
    store = HashStore()
    store.set_timeout(timedelta(seconds=7))
    other = store.clone()
    assert other.timeout == timedelta(seconds=7)
    other.set_timeout(timedelta(seconds=1))
    assert store.timeout == timedelta(seconds=7)


def test_zero_timeout_means_no_timeout() -> None:
    # PyTorch's HashStore treats a zero timeout as "wait forever".
    store = HashStore()
    store.set_timeout(timedelta(0))
    got, _ = run_threads(lambda: store.get("k"), later(lambda: store.set("k", "v"), 0.2))
    assert got == b"v"


def test_queue_pop_timeout_names_the_key() -> None:
    store = HashStore()
    store.set_timeout(timedelta(milliseconds=20))
    with pytest.raises(DistStoreError, match="my_queue"):
        store.queue_pop("my_queue")


def test_blocked_waiter_does_not_block_other_operations() -> None:
    store = HashStore()
    store.set_timeout(LONG)
    errors: list[Exception] = []

    def wait_in_vain() -> None:
        try:
            store.wait(["never"], timedelta(milliseconds=300))
        except DistStoreError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait_in_vain, daemon=True)
    waiter.start()
    start = time.monotonic()
    store.set("k", "v")
    assert store.get("k") == b"v" and store.num_keys() == 1
    assert time.monotonic() - start < 0.2
    waiter.join(5)
    assert len(errors) == 1


def _script(store) -> list:
    """A fixed sequence of operations whose results PyTorch's stores define."""
    out = [store.num_keys(), store.add("c", 5), store.add("c", -2), store.get("c")]
    out += [store.compare_set("m", "x", "y"), store.check(["m"]), store.compare_set("m", "", "y")]
    out += [store.compare_set("m", "z", "w"), store.compare_set("m", "y", "w"), store.get("m")]
    store.append("ap", "x")
    store.append("ap", "y")
    store.multi_set(["k1", "k2"], ["1", b"2"])
    out += [store.get("ap"), store.multi_get(["k2", "k1"]), store.delete_key("m")]
    out += [store.delete_key("m"), store.num_keys(), store.has_extended_api()]
    store.queue_push("q", "a")
    store.queue_push("q", "b")
    out += [store.queue_len("q"), store.queue_pop("q"), store.queue_pop("q", False), store.queue_len("q")]
    return out


def test_same_results_as_pytorchs_hash_store() -> None:
    dist = pytest.importorskip("torch.distributed")
    assert _script(HashStore()) == _script(dist.HashStore())
