"""shrink_group: PyTorch's argument checks, and survivors of a SIGKILLed rank carrying on.

PyTorch implements shrinking for NCCL only; torchdist rebuilds the group through the store
on every CPU backend. The rank functions kill a rank after a barrier (the fault-tolerance
case), so ``run_ranks`` raises RanksFailed naming it, and the survivors' results are read
from the report's outcomes.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch

import torchdist as dist
from torchdist._c10d.shrink import _validate_excluded
from torchdist._c10d.world import WORLD
from torchdist.errors import DistError, DistStoreError
from torchdist.testing import RanksFailed, run_ranks

BACKENDS = ["tcp", "shm", "gloo"]
#: Survivors go on after a rank dies: let them finish (run_ranks' default grace is 3 s).
GRACE_S = 30.0


def _survivors(info: pytest.ExceptionInfo, dead: list[int]) -> dict[int, object]:
    """The results of the ranks that returned; the ranks in ``dead``, and only they, died."""
    assert info.value.failed_ranks == dead, str(info.value)
    return {o.rank: o.result for o in info.value.outcomes if o.rank not in dead}


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _registration(group) -> str:
    """Whether ``group`` is still registered, or the error that says it is not."""
    try:
        dist.get_process_group_ranks(group)
        return "still registered"
    except ValueError as exc:
        return str(exc)


def _sum_of_ranks(rank: int) -> float:
    """The all-reduced sum of this rank's old rank over the default group."""
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


# -- validation: PyTorch's types and messages -------------------------------------------------
def _error(fn, *args) -> tuple[str, str] | None:
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - compared below
        return type(exc).__name__, str(exc)
    return None


class _FakeGroup:
    """What _validate_excluded reads of a group: its size and this rank's rank."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


INPUT_CASES = [((1,), 0), ("0", 0), (None, 0), ([], 0), ([1], 2), ([1], -1), ([1], "1"), ([1], 1.0)]
RANK_CASES = [[1.0], ["1"], [4], [-1], [1, 1], [0, 1, 2, 3], [2, 1, 3, 0], [0], [1, 0]]


@pytest.mark.parametrize("ranks, flags", INPUT_CASES)
def test_input_checks_match_pytorchs(ranks, flags) -> None:
    from torch.distributed import distributed_c10d as torch_c10d

    ours = _error(dist.shrink_group, ranks, None, flags)
    theirs = _error(torch_c10d._validate_shrink_inputs, ranks, flags)
    assert theirs is not None and ours == theirs


@pytest.mark.parametrize("ranks", RANK_CASES)
def test_excluded_rank_checks_match_pytorchs(ranks) -> None:
    from torch.distributed import distributed_c10d as torch_c10d

    ours = _error(_validate_excluded, ranks, _FakeGroup(4, 0))
    theirs = _error(torch_c10d._validate_and_process_excluded_ranks, ranks, {"group_size": 4, "current_rank": 0})
    assert theirs is not None and ours == theirs


def test_flags_and_exports_match_pytorchs() -> None:
    from torch.distributed import distributed_c10d as torch_c10d

    flags = (dist.distributed_c10d.SHRINK_DEFAULT, dist.distributed_c10d.SHRINK_ABORT)
    assert flags == (torch_c10d.SHRINK_DEFAULT, torch_c10d.SHRINK_ABORT) == (0, 1)
    assert not hasattr(dist, "SHRINK_DEFAULT")  # as torch.distributed: in distributed_c10d only
    assert dist.distributed_c10d.SHRINK_ABORT == 1 and "shrink_group" in dist.distributed_c10d.__all__
    assert "shrink_group" in dist.__all__ and "shrink_group" in torch_c10d.__all__


def test_needs_a_default_group() -> None:
    with pytest.raises(ValueError, match="Default process group has not been initialized"):
        dist.shrink_group([1])


def _checks_in_a_group(rank: int, world: int) -> list[tuple[str, str] | None]:
    sub = dist.new_group([0])
    errors = [
        _error(dist.shrink_group, [rank]),  # this rank excludes itself
        _error(dist.shrink_group, [0, 1]),  # everyone
        _error(dist.shrink_group, [2]),  # out of bounds
        _error(dist.shrink_group, [1], sub) if rank == 0 else None,  # a group of one
    ]
    dist.barrier()  # the group is intact after all these
    return errors


def test_checks_in_a_group() -> None:
    results = run_ranks(_checks_in_a_group, 2, backend="tcp", timeout=60)
    for rank, (itself, everyone, bounds, single) in enumerate(results):
        assert itself[0] == "RuntimeError" and f"Current rank {rank} is in the exclusion list" in itself[1]
        assert everyone[0] == "ValueError" and "Cannot exclude all 2 ranks" in everyone[1]
        assert bounds[0] == "ValueError" and "out of bounds for group size 2" in bounds[1]
        if rank == 0:
            assert single == ("ValueError", "Cannot shrink a process group with size 1. Group must have at least 2 "
                                            "ranks to support shrinking.")


# -- survivors of a killed rank shrink the default group --------------------------------------
def _kill_then_shrink(rank: int, world: int, victim: int) -> dict:
    other = dist.new_group(list(range(world)))  # destroyed by the shrink of the default group
    dist.barrier()
    if rank == victim:
        _die()
    new = dist.shrink_group([victim])
    n = world - 1
    out = {"default": new is dist.group.WORLD, "rank": dist.get_rank(), "size": dist.get_world_size(),
           "ranks": dist.get_process_group_ranks(None), "global": dist.get_global_rank(new, dist.get_rank()),
           "name": new.group_name}
    out["other"] = _registration(other)
    out["sum"] = _sum_of_ranks(rank)
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=n - 1)
    out["bcast"] = b.item()
    pair = dist.new_group([0, n - 1])  # new_group takes the new numbering
    if dist.get_rank() in (0, n - 1):
        p = torch.tensor([float(rank)])
        dist.all_reduce(p, group=pair)
        out["pair"] = p.item()
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world, victim", [(3, 2), (4, 1)])
def test_survivors_of_a_killed_rank_shrink_the_default_group(backend: str, world: int, victim: int) -> None:
    with pytest.raises(RanksFailed) as info:
        run_ranks(_kill_then_shrink, world, args=(victim,), backend=backend, timeout=90, grace=GRACE_S)
    results = _survivors(info, [victim])
    old = [r for r in range(world) if r != victim]
    for rank, out in results.items():
        assert out["default"] and out["rank"] == old.index(rank) and out["size"] == world - 1, out
        assert out["ranks"] == list(range(world - 1)) and out["global"] == out["rank"], out
        assert "is not registered" in out["other"], out
        assert out["sum"] == sum(old) and out["bcast"] == old[-1], out
        if rank in (old[0], old[-1]):
            assert out["pair"] == old[0] + old[-1], out
    assert len({out["name"] for out in results.values()}) == 1


# -- a subgroup ---------------------------------------------------------------------------------
def _shrink_a_subgroup(rank: int, world: int) -> dict:
    sub = dist.new_group([1, 2, 3])
    out: dict = {}
    if rank in (1, 3):  # global rank 2 (rank 1 of sub) is left out; it need not take part
        new = dist.shrink_group([1], group=sub)
        out["ranks"] = dist.get_process_group_ranks(new)
        out["rank"], out["size"] = new.rank(), new.size()
        out["default_kept"] = dist.get_world_size() == 4 and dist.get_rank() == rank
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=new)
        out["sum"] = t.item()
        with pytest.raises(ValueError, match="is not registered"):
            dist.get_process_group_ranks(sub)
        out["group_rank_of_3"] = dist.get_group_rank(new, 3)
    dist.barrier()  # the default group is untouched
    return out


def test_shrink_a_subgroup_keeps_global_ranks_and_the_default_group() -> None:
    results = run_ranks(_shrink_a_subgroup, 4, backend="tcp", timeout=60)
    for rank in (1, 3):
        out = results[rank]
        assert out["ranks"] == [1, 3] and out["rank"] == [1, 3].index(rank) and out["size"] == 2, out
        assert out["default_kept"] and out["sum"] == 4.0 and out["group_rank_of_3"] == 1, out


# -- two shrinks in a row ------------------------------------------------------------------------
def _shrink_twice(rank: int, world: int) -> dict:
    dist.barrier()
    if rank == 3:
        _die()
    dist.shrink_group([3])
    pair = dist.new_group([0, 1])  # made in the shrunk world, destroyed by the next shrink
    if dist.get_rank() < 2:
        dist.all_reduce(torch.ones(1), group=pair)
    dist.barrier()
    if rank == 1:  # new rank 1 of the three
        _die()
    new = dist.shrink_group([1])
    out = {"rank": dist.get_rank(), "size": dist.get_world_size(), "name": new.group_name}
    out["pair"] = _registration(pair)
    out["sum"] = _sum_of_ranks(rank)
    local = dist.new_group([0, 1], use_local_synchronization=True)  # fresh store namespace: no stale keys
    t = torch.tensor([out["sum"]])
    dist.all_reduce(t, group=local)
    out["local"] = t.item()
    return out


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_two_successive_shrinks(backend: str) -> None:
    with pytest.raises(RanksFailed) as info:
        run_ranks(_shrink_twice, 4, backend=backend, timeout=90, grace=GRACE_S)
    results = _survivors(info, [1, 3])
    assert results[0]["rank"] == 0 and results[2]["rank"] == 1
    for out in results.values():
        assert out["size"] == 2 and out["sum"] == 2.0 and out["local"] == 4.0, out
    assert "is not registered" in results[0]["pair"]  # (old rank 2 was not in the pair: NON_GROUP_MEMBER)
    assert results[0]["name"] == results[2]["name"]


# -- SHRINK_ABORT --------------------------------------------------------------------------------
def _abort_pending(rank: int, world: int, flags: int) -> dict:
    dist.barrier()
    if rank == 2:
        _die()
    work = dist.irecv(torch.empty(1), src=1 - rank)  # never sent: pending until aborted
    time.sleep(0.2)
    start = time.monotonic()
    dist.shrink_group([2], shrink_flags=flags)
    out: dict = {}
    try:
        work.wait()
        out["pending"] = "completed"
    except DistError as exc:
        out["pending"] = f"{type(exc).__name__}: {exc}"
    out["elapsed"] = time.monotonic() - start
    t = torch.ones(1)
    dist.all_reduce(t)
    out["sum"] = t.item()
    return out


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_shrink_abort_fails_the_pending_ops_of_the_parent(backend: str) -> None:
    with pytest.raises(RanksFailed) as info:
        run_ranks(_abort_pending, 3, args=(dist.distributed_c10d.SHRINK_ABORT,), backend=backend, timeout=60,
                  grace=GRACE_S)
    for out in _survivors(info, [2]).values():
        assert out["pending"] != "completed" and "abort" in out["pending"], out
        assert out["elapsed"] < 15 and out["sum"] == 2.0, out


# -- a survivor that never comes -------------------------------------------------------------------
def _one_survivor_missing(rank: int, world: int) -> tuple[str, str, float] | None:
    dist.init_process_group("tcp", timeout=timedelta(seconds=3))
    store = WORLD.store
    result = None
    if rank == 0:
        start = time.monotonic()
        try:
            dist.shrink_group([2])
        except Exception as exc:  # noqa: BLE001 - returned for the test to judge
            result = type(exc).__name__, str(exc), time.monotonic() - start
        store.set("test/done", b"1")
    else:  # rank 1 should call shrink_group but does not; rank 2 is excluded
        store.wait(["test/done"], timedelta(seconds=30))
    dist.destroy_process_group()
    return result


def test_a_survivor_that_never_calls_is_named_within_the_timeout() -> None:
    name, message, elapsed = run_ranks(_one_survivor_missing, 3, timeout=60)[0]
    assert name == DistStoreError.__name__, message
    assert "ranks [1]" in message and "did not call shrink_group" in message, message
    assert elapsed < 10, elapsed


# -- other backends: TypeError unless they say they can; pg_options reach the new backend -------------
def _custom_backends(rank: int, world: int, port: int) -> dict:
    from torchdist._process_group.backends.tcp import TcpBackend

    def shrinkable(opts, pg_options) -> TcpBackend:  # PyTorch's extended form of a backend creator
        backend = TcpBackend(opts.store, opts.group_rank, opts.group_size, opts.timeout, group_name=opts.group_id,
                             global_ranks=opts.global_ranks_in_group)
        backend.supports_shrinking, backend.pg_options = True, pg_options
        return backend

    dist.Backend.register_backend("plaintcp", lambda store, r, n, timeout: TcpBackend(store, r, n, timeout))
    dist.Backend.register_backend("shrinkable", shrinkable, extended_api=True)
    out = {}
    dist.init_process_group("plaintcp", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out["plain"] = _error(dist.shrink_group, [1 - rank])
    dist.destroy_process_group()
    dist.init_process_group("shrinkable", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if rank < 2:
        new = dist.shrink_group([2], pg_options={"tag": "mine"})
        out["options"] = new._get_backend().pg_options
        out["backend"] = dist.get_backend()
        t = torch.ones(1)
        dist.all_reduce(t)
        out["sum"] = t.item()
        WORLD.store.set(f"test/done/{rank}", b"1")
    else:  # excluded, alive: waits until the others are done with the store it hosts (rank 0 does)
        WORLD.store.wait(["test/done/0", "test/done/1"], timedelta(seconds=30))
    dist.destroy_process_group()
    return out


def test_other_backends_must_support_shrinking_and_get_pg_options() -> None:
    from torchdist.testing import free_port

    results = run_ranks(_custom_backends, 3, args=(free_port(),), timeout=60)
    for rank, out in enumerate(results):
        assert out["plain"] == ("TypeError", "Process group backend for '0' does not support shrinking operations.")
        if rank < 2:
            assert out["options"] == {"tag": "mine"} and out["backend"] == "shrinkable" and out["sum"] == 2.0, out


# -- the store's host among the dead --------------------------------------------------------------
def _store_host_killed(rank: int, world: int) -> tuple[str, str, float]:
    dist.barrier()
    if rank == 0:  # with env:// rank 0 hosts the TCPStore that the survivors would meet in
        _die()
    time.sleep(0.3)
    start = time.monotonic()
    try:
        dist.shrink_group([0])
    except Exception as exc:  # noqa: BLE001 - returned for the test to judge
        return type(exc).__name__, str(exc), time.monotonic() - start
    raise AssertionError("shrink_group succeeded without a store")


def test_losing_the_store_host_is_a_clear_error_not_a_hang() -> None:
    with pytest.raises(RanksFailed) as info:
        run_ranks(_store_host_killed, 3, backend="tcp", timeout=60, grace=GRACE_S)
    for name, message, elapsed in _survivors(info, [0]).values():
        assert name == DistStoreError.__name__ and "store is unreachable" in message, message
        assert elapsed < 10, elapsed


# -- survivors that disagree about whom to exclude ------------------------------------------------
def _disagree(rank: int, world: int) -> tuple[str, str] | None:
    dist.init_process_group("tcp", timeout=timedelta(seconds=10))
    result = None
    if rank < 3:  # rank 0 also excludes rank 2; ranks 1 and 2 exclude only rank 3
        result = _error(dist.shrink_group, [2, 3] if rank == 0 else [3])
        WORLD.store.set(f"test/done/{rank}", b"1")
    else:
        WORLD.store.wait([f"test/done/{r}" for r in range(3)], timedelta(seconds=30))
    dist.destroy_process_group()
    return result


def test_survivors_that_disagree_about_the_excluded_ranks_raise() -> None:
    results = run_ranks(_disagree, 4, timeout=60)
    for rank in range(3):
        name, message = results[rank]
        assert name == "ValueError" and "disagree about ranks_to_exclude" in message, message
