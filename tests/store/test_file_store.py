"""FileStore: the conformance suite, several processes on one file, reference
counting, and logs that are not valid.

The functions that run on ranks are at module level, where
``torchdist.testing.run_ranks`` finds them by reference.
"""

from __future__ import annotations

import gc
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest

from torchdist._store.file_store import FileStore
from torchdist.errors import DistStoreError
from torchdist.testing import run_ranks

from .conformance import LONG, StoreConformance, later, run_threads


class TestFileStoreConformance(StoreConformance):
    internal_keys = 1  # the reference count, as in PyTorch

    def make_store(self, tmp_path: Path) -> FileStore:
        return FileStore(str(tmp_path / "store"), -1)


@pytest.fixture
def path(tmp_path: Path) -> str:
    return str(tmp_path / "store")


# -- one process ---------------------------------------------------------------------
def test_a_path_that_cannot_hold_a_store_raises_dist_store_error() -> None:
    if not os.path.exists("/proc/version"):
        pytest.skip("needs /proc")
    with pytest.raises(DistStoreError, match="FileStore: cannot use '/proc/version'"):
        FileStore("/proc/version", 1)


def test_path_attribute_and_extended_api(path: str) -> None:
    with FileStore(path) as store:
        assert store.path == path
        # append/multi_*/queues are native here, unlike PyTorch's FileStore.
        assert store.has_extended_api() is True


def test_two_handles_share_data(path: str) -> None:
    with FileStore(path) as a, FileStore(path) as b:
        a.set("from_a", "1")
        b.add("n", 2)
        a.add("n", 3)
        assert b.get("from_a") == b"1"
        assert a.get("n") == b"5"
        assert sorted(b.list_keys()) == ["from_a", "n"]


def test_an_existing_empty_file_becomes_a_store(path: str) -> None:
    Path(path).touch()
    with FileStore(path) as store:
        store.set("k", "v")
        assert store.get("k") == b"v"


def test_num_keys_counts_refcount_then_cleanup(path: str) -> None:
    # PyTorch's count: 1 internal key after the first open, 2 after the first close.
    store = FileStore(path)
    assert store.num_keys() == 1
    store.set("k", "v")
    assert store.num_keys() == 2
    FileStore(path).close()
    assert store.num_keys() == 3
    assert store.list_keys() == ["k"]
    store.close()


def test_last_of_world_size_users_to_close_deletes_the_file(path: str) -> None:
    a, b = FileStore(path, 2), FileStore(path, 2)
    a.close()
    assert os.path.exists(path)
    b.close()
    assert not os.path.exists(path)


def test_cleanup_waits_for_every_open_handle(path: str) -> None:
    # world_size=1 with two handles: the first close reaches world_size, but the
    # other handle is still open, so the file stays until that one closes.
    a, b = FileStore(path, 1), FileStore(path, 1)
    a.close()
    assert os.path.exists(path)
    b.close()
    assert not os.path.exists(path)


def test_world_size_minus_one_never_deletes(path: str) -> None:
    FileStore(path).close()
    FileStore(path, -1).close()
    assert os.path.exists(path)
    with FileStore(path) as store:
        assert store.num_keys() == 2  # refcount and cleanup survived


def test_garbage_collection_closes(path: str) -> None:
    store = FileStore(path, 1)
    store.set("k", "v")
    del store
    gc.collect()
    assert not os.path.exists(path)


def test_close_is_idempotent_and_closed_store_refuses(path: str) -> None:
    store = FileStore(path)
    store.close()
    store.close()
    with pytest.raises(DistStoreError, match="closed"):
        store.get("k")
    with pytest.raises(DistStoreError, match="closed"):
        store.set("k", "v")


def test_clone_holds_its_own_reference(path: str) -> None:
    store = FileStore(path, 1)
    store.set_timeout(timedelta(seconds=3))
    other = store.clone()
    assert other.timeout == timedelta(seconds=3)
    store.close()
    assert os.path.exists(path)
    other.set("k", "still works")
    assert other.get("k") == b"still works"
    other.close()
    assert not os.path.exists(path)


def test_zero_timeout_means_no_timeout(path: str) -> None:
    # PyTorch's FileStore treats a zero timeout as "wait forever".
    with FileStore(path) as store, FileStore(path) as writer:
        store.set_timeout(timedelta(0))
        got, _ = run_threads(lambda: store.get("k"), later(lambda: writer.set("k", "v"), 0.2))
        assert got == b"v"


def test_unopenable_path_raises_dist_store_error(tmp_path: Path) -> None:
    with pytest.raises(DistStoreError, match="cannot open"):
        FileStore(str(tmp_path / "missing_dir" / "store"))


def test_handle_inherited_through_fork_gets_its_own_lock(path: str) -> None:
    store = FileStore(path, 1)
    pid = os.fork()
    if pid == 0:  # the child: use the parent's handle, then leave without cleanup
        code = 1
        try:
            code = 0 if store.add("n", 5) >= 5 else 1
            store.close()  # the reference is the parent's: must not be released
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.add("n", 1) == 6
    assert os.path.exists(path)
    store.close()
    assert not os.path.exists(path)


# -- logs that are not valid -----------------------------------------------------------
def test_a_foreign_file_is_refused(path: str) -> None:
    Path(path).write_bytes(b"these are not the bytes you are looking for")
    with pytest.raises(DistStoreError, match="not a valid store log at byte 0"):
        FileStore(path)


@pytest.mark.parametrize(
    "junk, what",
    [
        (b"S\x05\x00\x00\x00ab", "cut short"),  # a key shorter than its length
        (b"S\xff\xff\xff\xff", "cut short"),  # an absurd length
        (b"S\x01\x00\x00\x00k\x02", "cut short"),  # a value length cut short
        (b"Z\x00\x00\x00\x00\x00\x00\x00\x00", "unknown record type"),
    ],
)
def test_a_corrupt_record_raises_at_once(path: str, junk: bytes, what: str) -> None:
    store = FileStore(path)
    store.set_timeout(LONG)
    store.set("before", "1")
    with open(path, "ab") as f:
        f.write(junk)
    start = time.monotonic()
    with pytest.raises(DistStoreError, match=what):
        store.get("after")
    assert time.monotonic() - start < 1.0
    with pytest.raises(DistStoreError, match=what):
        FileStore(path)
    # close() cannot record the release in a broken log: it says so, and still closes.
    with pytest.raises(DistStoreError, match=what):
        store.close()
    with pytest.raises(DistStoreError, match="closed"):
        store.get("before")


def test_a_file_that_shrank_raises(path: str) -> None:
    store = FileStore(path)
    store.set("k", "value")
    os.truncate(path, os.path.getsize(path) - 3)
    with pytest.raises(DistStoreError, match="shrank"):
        store.check(["k"])
    with pytest.raises(DistStoreError, match="shrank"):
        store.close()


# -- parity with PyTorch -----------------------------------------------------------------
def _file_script(make) -> list:
    """Results PyTorch's FileStore defines: counts, counters, compare_set."""
    store = make()
    out = [store.num_keys(), store.add("c", 5), store.add("c", -2), store.get("c")]
    store.set("k", b"\x00v")
    out += [store.num_keys(), store.get("k")]
    out += [store.compare_set("m", "x", "y"), store.check(["m"]), store.compare_set("m", "", "y")]
    out += [store.compare_set("m", "z", "w"), store.compare_set("m", "y", "w"), store.get("m")]
    out += [store.delete_key("m"), store.num_keys(), store.check(["m"])]
    other = make()
    other.set("from_other", "1")
    del other
    gc.collect()
    out += [store.num_keys(), store.get("from_other")]
    return out


def test_same_results_as_pytorchs_file_store(tmp_path: Path) -> None:
    dist = pytest.importorskip("torch.distributed")
    ours = _file_script(lambda: FileStore(str(tmp_path / "ours"), -1))
    theirs = _file_script(lambda: dist.FileStore(str(tmp_path / "theirs"), -1))
    assert ours == theirs


# -- several processes ------------------------------------------------------------------
def _add_many(rank: int, world_size: int, path: str, adds: int) -> tuple[list[int], bytes]:
    store = FileStore(path, world_size)
    store.set_timeout(timedelta(seconds=30))
    totals = [store.add("n", 1) for _ in range(adds)]
    store.barrier("added", world_size)
    final = store.get("n")
    store.close()
    return totals, final


def test_concurrent_adds_from_processes_are_exact_and_last_close_deletes(path: str) -> None:
    world_size, adds = 4, 100
    results = run_ranks(_add_many, world_size, args=(path, adds), timeout=60)
    every_total = sorted(t for totals, _ in results for t in totals)
    assert every_total == list(range(1, world_size * adds + 1))
    assert {final for _, final in results} == {str(world_size * adds).encode()}
    assert not os.path.exists(path)


def _wait_or_release(rank: int, world_size: int, path: str) -> float:
    with FileStore(path) as store:
        store.set_timeout(timedelta(seconds=30))
        if rank == 0:
            store.set("waiting", "1")
            start = time.monotonic()
            store.wait(["released"])
            return time.monotonic() - start
        store.wait(["waiting"])
        time.sleep(0.2)
        store.set("released", "1")
        return 0.0


def test_wait_released_by_another_process(path: str) -> None:
    waited, _ = run_ranks(_wait_or_release, 2, args=(path,), timeout=60)
    assert 0.15 < waited < 5.0


def _share(rank: int, world_size: int, path: str) -> list[bytes]:
    with FileStore(path) as store:
        store.set_timeout(timedelta(seconds=30))
        store.set(f"rank{rank}", f"hello from {rank}")
        return store.multi_get([f"rank{r}" for r in range(world_size)])


def test_processes_and_the_parent_share_one_store(path: str) -> None:
    with FileStore(path) as parent:
        parent.set("parent", "here")
        results = run_ranks(_share, 3, args=(path,), timeout=60)
        expected = [f"hello from {r}".encode() for r in range(3)]
        assert results == [expected] * 3
        assert parent.get("rank2") == b"hello from 2"


def _produce_or_consume(rank: int, world_size: int, path: str, per_consumer: int) -> list[int]:
    with FileStore(path) as store:
        store.set_timeout(timedelta(seconds=30))
        if rank == 0:
            for i in range(per_consumer * (world_size - 1)):
                store.queue_push("work", str(i))
            return []
        return [int(store.queue_pop("work")) for _ in range(per_consumer)]


def test_queue_items_are_popped_once_across_processes(path: str) -> None:
    per_consumer = 15
    results = run_ranks(_produce_or_consume, 4, args=(path, per_consumer), timeout=60)
    popped = [i for r in results[1:] for i in r]
    assert sorted(popped) == list(range(per_consumer * 3))
    assert all(r == sorted(r) for r in results[1:])  # each consumer sees FIFO order
