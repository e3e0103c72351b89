"""Argument rules of the c10d API that PyTorch 2.13 enforces, with its exception types.

Each case was run on torch.distributed (gloo) and on torchdist side by side; the
expected types below are what torch 2.13 raised. A rank that makes a local mistake
then makes the correct call, so its peers' collective completes.
"""

from datetime import timedelta

import pytest
import torch

import torchdist as dist
from torchdist.testing import run_ranks


def _raises(kind, fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except kind as exc:
        return type(exc).__name__
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {kind.__name__}")


def _rooted_lists(rank, world):
    got = {}
    me = torch.tensor([rank + 1.0])
    if rank == 0:
        # gather: the root's list must hold tensors shaped as the input (torch: RuntimeError)
        got["gather wrong size"] = _raises(RuntimeError, dist.gather, me, [torch.zeros(2)] * world, dst=0)
        got["gather wrong shape"] = _raises(RuntimeError, dist.gather, torch.zeros(1, 2),
                                            [torch.zeros(2, 1)] * world, dst=0)
        got["gather no list"] = _raises(ValueError, dist.gather, me, None, dst=0)
        got["gather empty list"] = _raises(ValueError, dist.gather, me, [], dst=0)
        out = [torch.zeros(1) for _ in range(world)]
        dist.gather(me, out, dst=0)
        got["gather"] = [t.item() for t in out]
        got["scatter wrong size"] = _raises(RuntimeError, dist.scatter, torch.zeros(1),
                                            [torch.zeros(2)] * world, src=0)
        got["scatter no list"] = _raises(ValueError, dist.scatter, torch.zeros(1), None, src=0)
        mine = torch.zeros(1)
        dist.scatter(mine, [torch.tensor([10.0 * j]) for j in range(world)], src=0)
    else:
        dist.gather(me, None, dst=0)
        mine = torch.zeros(1)
        dist.scatter(mine, None, src=0)
    got["scatter"] = mine.item()
    return got


def test_gather_and_scatter_check_the_roots_list_as_pytorch():
    for rank, got in enumerate(run_ranks(_rooted_lists, 3, backend="gloo", timeout=60)):
        assert got["scatter"] == 10.0 * rank
        if rank == 0:
            assert got["gather"] == [1.0, 2.0, 3.0]
            assert got["gather wrong size"] == got["gather wrong shape"] == got["scatter wrong size"] == "RuntimeError"


def _objects(rank, world):
    got = {}
    objs = [f"from {rank}", {"rank": rank}]
    dist.broadcast_object_list(objs)  # src defaults to 0, as in PyTorch
    got["broadcast"] = objs
    if rank == 0:
        _raises(ValueError, dist.gather_object, "x", [], dst=0)  # the destination's list is falsy
        out = [None] * world
        dist.gather_object(rank, out, dst=0)
        got["gather"] = out
        _raises(RuntimeError, dist.scatter_object_list, [None], ["too", "many", "objects", "here"][:world + 1])
        _raises(ValueError, dist.scatter_object_list, [None], None)
        out = [None]
        dist.scatter_object_list(out, [f"to {j}" for j in range(world)])
        got["scatter"] = out[0]
        _raises(ValueError, dist.recv_object_list, [None])  # no any-source receive of objects
        _raises(ValueError, dist.recv_object_list, [None], src=0)  # from itself
        received = [None]
        got["sender"] = dist.recv_object_list(received, src=1)
        got["received"] = received[0]
    else:
        _raises(ValueError, dist.gather_object, rank, [None] * world, dst=0)  # a list off the destination
        dist.gather_object(rank, None, dst=0)
        out = [None]
        dist.scatter_object_list(out, None)
        got["scatter"] = out[0]
        if rank == 1:
            dist.send_object_list(["hello"], dst=0)
    return got


def test_object_collectives_take_pytorchs_defaults_and_list_rules():
    results = run_ranks(_objects, 2, backend="gloo", timeout=60)
    for rank, got in enumerate(results):
        assert got["broadcast"] == ["from 0", {"rank": 0}]
        assert got["scatter"] == f"to {rank}"
    assert results[0]["gather"] == [0, 1]
    assert results[0]["sender"] == 1 and results[0]["received"] == "hello"


def _roots_and_ranks(rank, world):
    got = {}
    sub = dist.new_group([world - 1, 0], sort_ranks=False)  # group rank 0 is global rank world - 1
    t = torch.zeros(1)
    if rank in (0, world - 1):  # a global root outside the world is not part of a subgroup (ValueError) ...
        got["subgroup root"] = _raises(ValueError, dist.broadcast, t, src=world, group=sub)
    # ... and is an invalid root of the default group (RuntimeError), as in PyTorch.
    got["world root"] = _raises(RuntimeError, dist.broadcast, t, src=world)
    got["float root"] = _raises(TypeError, dist.broadcast, t, src=1.0)
    got["pg count"] = dist.get_pg_count()
    got["world group rank"] = dist.get_group_rank(dist.group.WORLD, 99)  # unchecked on the default group
    got["world global rank"] = dist.get_global_rank(dist.group.WORLD, 99)
    _raises(ValueError, dist.get_group_rank, None, 0)
    if rank in (0, world - 1):
        got["sub group rank"] = dist.get_group_rank(sub, world - 1)
    work = None
    if rank == 0:
        buf = torch.zeros(1)
        work = dist.irecv(buf)
        work.wait()
        got["source rank"] = work._source_rank()  # PyTorch's private method, as well as source_rank()
    elif rank == 1:
        dist.send(torch.ones(1), dst=0)
    return got


def test_roots_and_rank_queries_follow_pytorch():
    for rank, got in enumerate(run_ranks(_roots_and_ranks, 3, backend="gloo", timeout=60)):
        assert got["pg count"] == 2  # the default group and one new_group
        assert got["world group rank"] == got["world global rank"] == 99
        if rank in (0, 2):
            assert got["sub group rank"] == 0
        if rank == 0:
            assert got["source rank"] == 1


def _group_arguments(rank, world):
    got = {}
    got["int timeout"] = _raises(TypeError, dist.new_group, [0, 1], timeout=30)
    got["str ranks"] = _raises(TypeError, dist.new_group, ["0", "1"])
    got["empty ranks"] = _raises(TypeError, dist.new_group, [])
    # Only the members call it: a non-member calling anyway gets None.
    got["local non-member"] = dist.new_group([0, 1], use_local_synchronization=True) if rank == 2 else "member"
    if rank < 2:
        dist.new_group([0, 1], use_local_synchronization=True)
    parent = dist.new_group([1, 2])
    if rank in (1, 2):
        split = dist.split_group(parent, [[0], [1]])  # group ranks of the parent: global 1 and 2
        got["split"] = dist.get_process_group_ranks(split)
        _raises(ValueError, dist.split_group, parent, [[0], []])
        _raises(ValueError, dist.split_group, parent, [[2]])  # the parent has group ranks 0 and 1
    got["destroy a string"] = _raises(ValueError, dist.destroy_process_group, "x")
    return got


def test_group_construction_checks_arguments_as_pytorch():
    results = run_ranks(_group_arguments, 3, backend="gloo", timeout=60)
    assert results[2]["local non-member"] is None
    assert results[1]["split"] == [1] and results[2]["split"] == [2]


def _destroy_twice(rank, world):
    dist.destroy_process_group()
    try:
        dist.destroy_process_group()
    except AssertionError:
        return "AssertionError"
    finally:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # for the harness's own destroy
    return "nothing"


def test_destroy_without_a_default_group_raises_as_pytorch():
    assert run_ranks(_destroy_twice, 1, backend="gloo", timeout=60) == ["AssertionError"]


def _int_timeout(rank, world):
    return _raises(TypeError, dist.init_process_group, "gloo", timeout=30)


def test_init_takes_a_timedelta_timeout_only():
    assert run_ranks(_int_timeout, 1, timeout=60) == ["TypeError"]


def _exception_types_of_queries_and_coalesced_ops(rank, world):
    import warnings
    got = {}
    got["all_reduce_coalesced []"] = _raises(NotImplementedError, dist.all_reduce_coalesced, [])
    got["all_gather_coalesced []"] = _raises(NotImplementedError, dist.all_gather_coalesced,
                                             [[] for _ in range(world)], [])
    got["barrier int timeout"] = _raises(TypeError, dist.barrier, timeout=5)
    got["get_rank str"] = _raises(ValueError, dist.get_rank, "x")
    got["get_backend str"] = _raises(ValueError, dist.get_backend, "x")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = torch.ones(2)
        dist.all_reduce_coalesced([t])
        dist.all_gather_coalesced([[torch.zeros(2)] for _ in range(world)], [t])
    got["warnings"] = sorted({str(w.message).split("`")[1] for w in caught if w.category is FutureWarning})
    got["value"] = t.tolist()
    return got


def test_queries_and_coalesced_ops_raise_and_warn_as_pytorch():
    for got in run_ranks(_exception_types_of_queries_and_coalesced_ops, 2, backend="gloo", timeout=60):
        assert got == {"all_reduce_coalesced []": "NotImplementedError",
                       "all_gather_coalesced []": "NotImplementedError", "barrier int timeout": "TypeError",
                       "get_rank str": "ValueError", "get_backend str": "ValueError",
                       "warnings": ["torchdist.all_gather_coalesced", "torchdist.all_reduce_coalesced"],
                       "value": [2.0, 2.0]}
