"""PrefixStore: the conformance suite over each kind of underlying store, the key
layout it writes, and the emulated extended API over a store without one."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from torchdist._store.base import Store
from torchdist._store.file_store import FileStore
from torchdist._store.hash_store import HashStore
from torchdist._store.prefix_store import PrefixStore

from .conformance import StoreConformance, run_threads


class CoreOnlyStore(Store):
    """A store with only the core operations (no append, multi_*, queues): what a
    user's own Store subclass often is. It delegates to a HashStore."""

    def __init__(self, inner: HashStore | None = None) -> None:
        super().__init__()
        self._inner = inner or HashStore()

    @property
    def timeout(self) -> timedelta:
        return self._inner.timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self._inner.set_timeout(timeout)

    def set(self, key: str, value: str | bytes) -> None:
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        return self._inner.get(key)

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._inner.compare_set(key, expected, desired)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def list_keys(self) -> list[str]:
        return self._inner.list_keys()

    def clone(self) -> CoreOnlyStore:
        return CoreOnlyStore(self._inner.clone())


class TestPrefixOverHashStoreConformance(StoreConformance):
    def make_store(self, tmp_path: Path) -> PrefixStore:
        return PrefixStore("pre", HashStore())


class TestPrefixOverFileStoreConformance(StoreConformance):
    internal_keys = 1  # num_keys counts the whole underlying store

    def make_store(self, tmp_path: Path) -> PrefixStore:
        return PrefixStore("pre", FileStore(str(tmp_path / "store")))


class TestNestedPrefixConformance(StoreConformance):
    def make_store(self, tmp_path: Path) -> PrefixStore:
        return PrefixStore("inner", PrefixStore("outer", HashStore()))


class TestPrefixOverCoreOnlyStoreConformance(StoreConformance):
    has_queues = False

    def make_store(self, tmp_path: Path) -> PrefixStore:
        return PrefixStore("pre", CoreOnlyStore())


# -- key layout ------------------------------------------------------------------------
@pytest.mark.parametrize("make_base", [HashStore, CoreOnlyStore], ids=["native", "emulated"])
def test_every_key_is_written_under_the_prefix(make_base) -> None:
    base = make_base()
    store = PrefixStore("pre", base)
    store.set("k", "v")
    store.append("log", "a")
    store.multi_set(["m1", "m2"], ["1", "2"])
    store.add("n", 3)
    assert base.get("pre/k") == b"v"
    assert base.get("pre/log") == b"a"
    assert base.get("pre/m2") == b"2"
    assert base.get("pre/n") == b"3"
    base.set("pre/x", "from below")
    assert store.multi_get(["x", "m1"]) == [b"from below", b"1"]
    assert not base.check(["k"])


def test_queues_are_written_under_the_prefix() -> None:
    base = HashStore()
    PrefixStore("pre", base).queue_push("q", "v")
    assert base.queue_len("pre/q") == 1


def test_nesting_stacks_the_prefixes_outermost_last() -> None:
    base = HashStore()
    store = PrefixStore("two", PrefixStore("one", base))
    store.set("k", "v")
    assert base.get("one/two/k") == b"v"
    assert store._underlying_non_prefix_store is base


def test_empty_prefix_still_adds_the_slash() -> None:
    base = HashStore()
    PrefixStore("", base).set("k", "v")
    assert base.check(["/k"])


def test_store_none_raises_value_error() -> None:
    with pytest.raises(ValueError, match="cannot be None"):
        PrefixStore("pre", None)


def test_underlying_store() -> None:
    base = HashStore()
    assert PrefixStore("pre", base).underlying_store is base


def test_has_extended_api_forwards() -> None:
    assert PrefixStore("pre", HashStore()).has_extended_api() is True
    assert PrefixStore("pre", CoreOnlyStore()).has_extended_api() is False


def test_timeout_is_the_underlying_stores() -> None:
    base = HashStore()
    store = PrefixStore("pre", base)
    store.set_timeout(timedelta(seconds=3))
    assert base.timeout == timedelta(seconds=3)
    base.set_timeout(timedelta(seconds=4))
    assert store.timeout == timedelta(seconds=4)


def test_num_keys_counts_the_whole_underlying_store() -> None:
    base = HashStore()
    base.set("elsewhere", "1")
    store = PrefixStore("pre", base)
    store.set("k", "v")
    assert store.num_keys() == 2


def test_list_keys_shows_only_this_prefix_without_it() -> None:
    base = HashStore()
    base.set("elsewhere", "1")
    base.set("prefix/k", "1")  # shares the first letters, not the namespace
    store = PrefixStore("pre", base)
    store.set("a", "1")
    PrefixStore("sub", store).set("b", "2")
    assert sorted(store.list_keys()) == ["a", "sub/b"]


def test_clone_is_a_prefix_store_on_the_same_data() -> None:
    store = PrefixStore("pre", HashStore())
    other = store.clone()
    assert isinstance(other, PrefixStore)
    other.set("k", "v")
    assert store.get("k") == b"v"


# -- emulation over a core-only store -------------------------------------------------
def test_core_only_store_gets_the_extended_api_built_from_its_core() -> None:
    """As from PyTorch's C++ base class: append from compare_set, multi_* from get/set."""
    store = CoreOnlyStore()
    assert store.has_extended_api() is False
    store.append("k", "v")
    store.append("k", b"w")
    store.multi_set(["a", "b"], ["1", b"2"])
    assert store.get("k") == b"vw" and store.multi_get(["a", "b", "k"]) == [b"1", b"2", b"vw"]


def test_emulated_append_loses_nothing_under_concurrency() -> None:
    base = CoreOnlyStore()
    handles = [PrefixStore("pre", base.clone()) for _ in range(4)]
    run_threads(
        *[lambda h=h, c=c: [h.append("log", c) for _ in range(50)] for h, c in zip(handles, "abcd")]
    )
    value = base.get("pre/log")
    assert len(value) == 200 and all(value.count(c.encode()) == 50 for c in "abcd")


def test_emulated_append_after_delete_starts_again() -> None:
    base = CoreOnlyStore()
    store = PrefixStore("pre", base)
    store.append("log", "old")
    store.delete_key("log")
    store.append("log", "new")
    assert store.get("log") == b"new"


def test_same_layout_as_pytorchs_prefix_store() -> None:
    dist = pytest.importorskip("torch.distributed")

    def layout(prefix_store, hash_store) -> list:
        store = prefix_store("two", prefix_store("one", hash_store()))
        store.set("k", "v")
        store.append("log", "a")
        store.multi_set(["m"], ["1"])
        base = store.underlying_store.underlying_store
        return [sorted(base.list_keys()), sorted(store.list_keys()), store.num_keys()]

    assert layout(PrefixStore, HashStore) == layout(dist.PrefixStore, dist.HashStore)


def test_a_store_subclass_below_receives_bytes() -> None:
    """As PyTorch's C++ PrefixStore: values reach a Python Store subclass as bytes."""
    seen: list[object] = []

    class Recording(CoreOnlyStore):
        def set(self, key: str, value: str | bytes) -> None:
            seen.append(value)
            super().set(key, value)

        def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
            seen.extend([expected, desired])
            return super().compare_set(key, expected, desired)

    store = PrefixStore("p", Recording())
    store.set("k", "v")
    store.compare_set("k", "v", "w")
    store.append("k", "x")  # emulated through compare_set
    assert seen and all(isinstance(value, bytes) for value in seen), seen
    assert store.get("k") == b"wx"


def test_optional_operations_of_a_core_only_store_raise_not_implemented_as_pytorch() -> None:
    for store in (Store(), PrefixStore("pre", Store()), PrefixStore("pre", CoreOnlyStore())):
        calls = [lambda: store.queue_push("q", "v"), lambda: store.queue_pop("q"), lambda: store.queue_len("q")]
        if not isinstance(store, PrefixStore) or type(store.underlying_store) is Store:
            calls.append(store.list_keys)  # (CoreOnlyStore has list_keys)
        for call in calls:
            with pytest.raises(NotImplementedError):
                call()
