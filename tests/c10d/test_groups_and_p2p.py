"""Groups, point-to-point, object collectives, monitored_barrier, and errors through the API."""

import os
import time
import warnings
from datetime import timedelta

import pytest
import torch

import torchdist as dist
from torchdist.testing import RanksFailed, run_ranks


def _subgroups(rank, world):
    evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
    mine = evens if rank % 2 == 0 else odds
    other = odds if rank % 2 == 0 else evens
    # Concurrent collectives on two disjoint groups, async, then waited.
    t = torch.full((1000,), float(rank))
    work = dist.all_reduce(t, group=mine, async_op=True)
    work.wait()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outsider = dist.all_reduce(torch.ones(1), group=other)
    reversed_group = dist.new_group([3, 1], sort_ranks=False)
    order = None
    if rank in (1, 3):
        outs = [torch.empty(1) for _ in range(2)]
        dist.all_gather(outs, torch.tensor([float(rank)]), group=reversed_group)
        order = [o.item() for o in outs]
    local = dist.new_group([0, 1], use_local_synchronization=True) if rank < 2 else None
    local_sum = None
    if local is not None:
        x = torch.ones(1)
        dist.all_reduce(x, group=local)
        local_sum = x.item()
    bcast = torch.zeros(1) if rank != 2 else torch.tensor([42.0])
    dist.broadcast(bcast, group=mine, group_src=1) if rank % 2 == 0 else dist.broadcast(bcast, group=mine, src=3)
    my_sub, all_subs = dist.new_subgroups(group_size=2)
    pair = torch.ones(1)
    dist.all_reduce(pair, group=my_sub)
    split = dist.split_group(split_ranks=[[0, 3], [1, 2]])
    split_ranks = dist.get_process_group_ranks(split)
    result = {
        "sum": t[0].item(),
        "outsider": outsider,
        "warned": any("does not belong to the given group" in str(w.message) for w in caught),
        "other_rank": dist.get_rank(other),
        "other_size": dist.get_world_size(other),
        "group_rank": dist.get_group_rank(mine, rank),
        "global_rank": dist.get_global_rank(mine, 1),
        "ranks": dist.get_process_group_ranks(mine),
        "order": order,
        "local_sum": local_sum,
        "bcast": bcast.item(),
        "pair": pair.item(),
        "n_subgroups": len(all_subs),
        "split": split_ranks,
    }
    dist.destroy_process_group(mine)
    dist.barrier()  # WORLD still works after destroying a subgroup
    with pytest.raises(ValueError, match="not registered"):
        dist.all_reduce(torch.ones(1), group=mine)
    return result


def test_subgroups_members_and_outsiders():
    results = run_ranks(_subgroups, 4, backend="tcp")
    for rank, r in enumerate(results):
        assert r["sum"] == (2.0 if rank % 2 == 0 else 4.0), r
        assert r["outsider"] is None and r["warned"], r
        assert (r["other_rank"], r["other_size"]) == (-1, -1), r
        assert r["group_rank"] == rank // 2 and r["global_rank"] == (2 if rank % 2 == 0 else 3), r
        assert r["ranks"] == ([0, 2] if rank % 2 == 0 else [1, 3]), r
        assert r["bcast"] == (42.0 if rank % 2 == 0 else 0.0) or rank == 3, r
        assert r["pair"] == 2.0 and r["n_subgroups"] == 2, r
        assert r["split"] == ([0, 3] if rank in (0, 3) else [1, 2]), r
    assert results[1]["order"] == [3.0, 1.0] and results[3]["order"] == [3.0, 1.0]
    assert [r["local_sum"] for r in results] == [2.0, 2.0, None, None]


def _subgroup_errors(rank, world):
    messages = []
    for call in (lambda: dist.new_subgroups_by_enumeration([[0, 1], [1, 2]]),
                 lambda: dist.new_subgroups_by_enumeration([[0, world]]),
                 lambda: dist.new_subgroups(group_size=3),
                 lambda: dist.get_group_rank(dist.new_group([0]), 1) if rank == 0 else dist.new_group([0])):
        try:
            call()
            messages.append("no error")
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def test_subgroup_argument_errors():
    messages = run_ranks(_subgroup_errors, 2, backend="tcp")[0]
    assert "Rank 1 has appeared in both subgroup 0 and 1" in messages[0]
    assert "out of range" in messages[1]
    assert "must not exceed the world size" in messages[2]
    assert "not part of group" in messages[3]


def _p2p(rank, world):
    out = {}
    if rank == 0:
        a, b = torch.zeros(2), torch.zeros(2)
        dist.recv(b, src=1, tag=2)
        dist.recv(a, src=1, tag=1)
        out["tags"] = (a.tolist(), b.tolist())
        senders = sorted(dist.recv(torch.zeros(1), tag=9) for _ in range(world - 1))
        out["any_source"] = senders
    else:
        if rank == 1:
            w1 = dist.isend(torch.full((2,), 1.0), dst=0, tag=1)
            w2 = dist.isend(torch.full((2,), 2.0), dst=0, tag=2)
            w1.wait()
            w2.wait()
        dist.send(torch.ones(1), dst=0, tag=9)
    # A ring with batch_isend_irecv.
    send, recv = torch.full((3,), float(rank)), torch.zeros(3)
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
    # as PyTorch's: the default group and the peer as global and group rank
    out["p2pop"] = (ops[0].group is dist.group.WORLD, ops[0].peer, ops[0].group_peer)
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    out["ring"] = recv[0].item()
    objects = [None, None]
    if rank == 0:
        dist.send_object_list([{"a": 1}, torch.ones(2)], dst=world - 1)
    elif rank == world - 1:
        dist.recv_object_list(objects, src=0)
        out["objects"] = (objects[0], objects[1].tolist())
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_point_to_point(world_size):
    results = run_ranks(_p2p, world_size, backend="tcp")
    assert results[0]["tags"] == ([1.0, 1.0], [2.0, 2.0])
    assert results[0]["any_source"] == list(range(1, world_size))
    assert [r["ring"] for r in results] == [float((r - 1) % world_size) for r in range(world_size)]
    assert [r["p2pop"] for r in results] == [(True, (r + 1) % world_size, (r + 1) % world_size)
                                             for r in range(world_size)]
    assert results[-1]["objects"] == ({"a": 1}, [1.0, 1.0])


def _leave_with_a_pending_irecv(rank, world, store_path):
    """Rank 1 leaves (destroys its group) with an irecv still pending; ranks 0 and 2,
    which never wait on it, go on exchanging messages."""
    store = dist.FileStore(store_path, world)
    if rank == 1:
        dist.irecv(torch.zeros(1), src=0)  # never sent
        dist.destroy_process_group()
        store.set("left", "1")
        return None
    store.wait(["left"])
    t = torch.zeros(1)
    if rank == 0:
        dist.send(torch.full((1,), 7.0), dst=2)
        return t.item()
    dist.recv(t, src=0)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as waiting_on_the_leaver:
        dist.recv(torch.zeros(1), src=1)
    return t.item(), str(waiting_on_the_leaver.value), time.monotonic() - start


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_rank_that_leaves_cleanly_does_not_break_the_others(backend, tmp_path):
    first, _, (received, error, seconds) = run_ranks(_leave_with_a_pending_irecv, 3, backend=backend,
                                                      args=(str(tmp_path / "store"),))
    assert (first, received) == (0.0, 7.0)
    assert "rank 1" in error and seconds < 10, (error, seconds)


def test_p2p_op_validation():
    with pytest.raises(ValueError, match="Invalid ``op``"):
        dist.P2POp(dist.broadcast, torch.ones(1), 1)
    with pytest.raises(ValueError, match="Invalid ``p2p_op_list``"):
        dist.batch_isend_irecv([object()])
    with pytest.raises(TypeError, match="must be a torch.Tensor"):  # at construction, as PyTorch
        dist.P2POp(dist.isend, [1], 1)


class _Payload:
    def __init__(self, rank):
        self.rank, self.tensor = rank, torch.arange(3) * rank


def _p2p_sizes(rank, world):
    """A receive larger than the message takes it into its leading bytes, as in gloo; a
    smaller one breaks the group, naming both sizes (gloo aborts the process)."""
    if rank == 0:
        dist.send(torch.arange(4, dtype=torch.float32), dst=1)
        dist.send(torch.ones(4), dst=1, tag=3)
        try:
            dist.barrier()  # the receiver's error breaks the group: this raises too
        except RuntimeError:
            pass
        return None
    larger = torch.full((8,), -1.0)
    dist.recv(larger, src=0)
    try:
        dist.recv(torch.zeros(2), src=0, tag=3)
    except RuntimeError as exc:
        return larger.tolist(), str(exc)
    raise AssertionError("a message larger than the receive was accepted")


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_p2p_receive_may_be_larger_than_the_message_not_smaller(backend):
    _, (larger, message) = run_ranks(_p2p_sizes, 2, backend=backend)
    assert larger == [0.0, 1.0, 2.0, 3.0, -1.0, -1.0, -1.0, -1.0]
    assert "rank 0 sent 16 bytes with tag 3 but rank 1's recv has room for 8 bytes" in message, message
    assert message.count("process group") == 1, message


def _tag_rules(rank, world):
    """Tags as PyTorch takes them; a refused tag raises at the call and leaves the group usable."""
    errors = []
    for tag, error in ((1.5, TypeError), (None, TypeError), ("a", TypeError), (1 << 31, TypeError),
                       (-1, RuntimeError)):
        for call in (lambda: dist.send(torch.ones(1), dst=1 - rank, tag=tag),
                     lambda: dist.irecv(torch.ones(1), src=1 - rank, tag=tag)):
            with pytest.raises(error):
                call()
            errors.append(error.__name__)
    t = torch.full((1,), float(rank))
    if rank == 0:
        dist.send(t, dst=1, tag=(1 << 31) - 1)
    else:
        dist.recv(t, src=0, tag=(1 << 31) - 1)
    dist.all_reduce(t)
    return errors, t.item()


def test_p2p_tags_are_checked_at_the_call():
    for errors, value in run_ranks(_tag_rules, 2, backend="tcp"):
        assert errors == ["TypeError"] * 8 + ["RuntimeError"] * 2
        assert value == 0.0


def _negative_tag_cannot_pass_a_monitored_barrier(rank, world):
    """A user's message with tag -1 would have matched monitored_barrier's own traffic."""
    if rank == 1:
        with pytest.raises(RuntimeError, match="Tag must be nonnegative"):
            dist.send(torch.zeros(1, dtype=torch.uint8), dst=0, tag=-1)
        return None
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=2))
    except RuntimeError as exc:
        return str(exc)
    raise AssertionError("monitored_barrier passed without rank 1")


def test_negative_tags_are_refused_so_monitored_barrier_stays_honest():
    message, _ = run_ranks(_negative_tag_cannot_pass_a_monitored_barrier, 2, backend="tcp")
    assert "Rank 1 failed to pass monitoredBarrier" in message, message


def _non_member_p2p(rank, world):
    group = dist.new_group([0, 1])
    if rank != 2:
        return None
    # PyTorch's NON_GROUP_MEMBER is the int -100, and programs compare with it.
    assert group == -100 and group is dist.GroupMember.NON_GROUP_MEMBER and isinstance(group, int)
    refused = []
    for call in (lambda: dist.send(torch.ones(1), dst=0, group=group),
                 lambda: dist.send_object_list([1], dst=0, group=group),
                 lambda: dist.recv_object_list([None], src=0, group=group)):
        with pytest.raises(ValueError, match="Invalid process group specified"):
            call()
        refused.append(True)
    with pytest.warns(UserWarning, match="does not belong to the given group"):
        assert dist.isend(torch.ones(1), dst=0, group=group) is None
    with pytest.warns(UserWarning, match="does not belong to the given group"):
        assert dist.recv(torch.ones(1), src=0, group=group) == -1
    return refused


def test_non_members_send_and_object_p2p_raise_as_in_pytorch():
    """PyTorch raises ValueError for send, send_object_list and recv_object_list on a rank
    outside the group, where isend, irecv and recv warn and return."""
    assert run_ranks(_non_member_p2p, 3, backend="tcp")[2] == [True] * 3


def _objects(rank, world):
    gathered = [None] * world
    dist.all_gather_object(gathered, _Payload(rank))
    bcast = [None, None] if rank else ["config", {"lr": 0.1}]
    dist.broadcast_object_list(bcast, src=0)
    at_root = [None] * world if rank == 0 else None
    dist.gather_object(("from", rank), at_root, dst=0)
    scattered = [None]
    dist.scatter_object_list(scattered, [f"item{r}" for r in range(world)] if rank == 0 else None, src=0)
    return [(p.rank, p.tensor.tolist()) for p in gathered], bcast, at_root, scattered[0]


@pytest.mark.parametrize("world_size", [1, 3])
def test_object_collectives(world_size):
    for rank, (gathered, bcast, at_root, scattered) in enumerate(run_ranks(_objects, world_size, backend="tcp")):
        assert gathered == [(r, [0, r, 2 * r]) for r in range(world_size)]
        assert bcast == ["config", {"lr": 0.1}]
        assert at_root == ([("from", r) for r in range(world_size)] if rank == 0 else None)
        assert scattered == f"item{rank}"


def _object_lists_of_other_lengths(rank, world):
    longer = [None] * (world + 1)
    dist.all_gather_object(longer, rank)
    at_root = ["keep"] * (world + 1) if rank == 0 else None
    dist.gather_object(rank, at_root, dst=0)
    short = [None] * (world - 1) if rank == 1 else [None] * world
    try:
        dist.all_gather_object(short, rank)  # the others complete; only rank 1 raises, after the collective
        error = None
    except IndexError as exc:
        error = str(exc)
    dist.barrier()  # still in step
    return longer, at_root, short, error


def test_object_lists_longer_or_shorter_than_the_group_as_pytorch():
    world = 3
    for rank, (longer, at_root, short, error) in enumerate(run_ranks(_object_lists_of_other_lengths, world,
                                                                     backend="tcp")):
        assert longer == [*range(world), None]  # entries past the group size are left alone
        assert at_root == ([*range(world), "keep"] if rank == 0 else None)
        if rank == 1:
            assert short == list(range(world - 1)) and "has no place" in error
        else:
            assert short == list(range(world)) and error is None


def _object_list_longer_than_sent(rank, world):
    if rank == 0:
        dist.send_object_list(["a", {"b": 2}], dst=1)
        dist.send_object_list(["after"], dst=1)
        return None
    mine = ["x", "y", "z"]
    try:
        dist.recv_object_list(mine, src=0)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    after = [None]
    dist.recv_object_list(after, src=0)  # the stream is still in step
    return mine, error, after


def test_recv_object_list_longer_than_what_was_sent_raises_and_leaves_the_list():
    _, (mine, error, after) = run_ranks(_object_list_longer_than_sent, 2, backend="tcp", timeout=60)
    assert mine == ["x", "y", "z"] and after == ["after"]
    assert "received 2 objects from rank 0 into a list of 3" in error, error


def _monitored_with_float_timeout(rank, world):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.monitored_barrier(timeout=5.0)
    return [str(w.message) for w in caught]


def test_monitored_barrier_takes_seconds_with_pytorchs_warning():
    for messages in run_ranks(_monitored_with_float_timeout, 2, backend="tcp", timeout=60):
        assert any("Please specify timeout arg as a timedelta" in m for m in messages), messages


def _monitored(rank, world, missing):
    if rank in missing:
        time.sleep(3)
        return "skipped"
    start = time.monotonic()
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=1), wait_all_ranks=True)
        return "passed"
    except dist.DistError as exc:
        return f"{time.monotonic() - start:.1f}s {exc}"


def test_monitored_barrier_passes_and_names_missing_ranks():
    assert run_ranks(_monitored, 3, args=((),), backend="tcp") == ["passed"] * 3
    results = run_ranks(_monitored, 4, args=((1, 2),), backend="tcp", timeout=30)
    assert "Ranks 1, 2 failed to pass monitoredBarrier in 1000 ms" in results[0], results[0]
    assert "received errors while waiting for send/recv from rank 0" in results[3], results[3]


def _late_then_on_time(rank, world):
    """Rank 2 misses the first monitored barrier; everyone makes the second."""
    outcomes = []
    for late in (2, None):
        if rank == late:
            time.sleep(2)
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=1))
            outcomes.append("passed")
        except dist.DistBackendError as exc:
            outcomes.append(str(exc))
    return outcomes


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_monitored_barrier_that_gives_up_breaks_the_group_on_every_rank(backend):
    """Its receives stayed posted: the next barrier's messages went to them, and rank 0
    passed it while the others timed out. Now it breaks the group, as gloo's closes
    its connections, and every rank raises at the next call."""
    results = run_ranks(_late_then_on_time, 3, backend=backend, timeout=60)
    assert "Rank 2 failed to pass monitoredBarrier in 1000 ms" in results[0][0], results[0]
    for rank, (first, second) in enumerate(results):
        assert first != "passed", rank
        assert "the group is broken by an earlier error" in second, (rank, second)


def _mismatch_then_broken(rank, world):
    t = torch.ones(4)
    start = time.monotonic()
    try:
        if rank == 0:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        else:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        first = "no error"
    except dist.DistBackendError as exc:
        first = str(exc)
    elapsed = time.monotonic() - start
    try:
        dist.all_reduce(t)
        later = "no error"
    except dist.DistBackendError as exc:
        later = str(exc)
    return first, later, elapsed


def test_mismatched_reduce_ops_raise_on_every_rank_and_break_the_group():
    for first, later, elapsed in run_ranks(_mismatch_then_broken, 3, backend="tcp"):
        assert "SUM" in first and "MAX" in first, first
        assert "broken" in later, later
        assert elapsed < 10


def _dies_or_waits(rank, world):
    dist.all_reduce(torch.ones(1))
    if rank == 1:
        os._exit(7)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1 << 16))
    except dist.DistError as exc:
        return f"{time.monotonic() - start:.1f} {exc}"
    return "no error"


def test_dead_rank_is_named_within_seconds():
    with pytest.raises(RanksFailed) as info:
        run_ranks(_dies_or_waits, 3, backend="tcp", timeout=30, grace=15)
    outcomes = {o.rank: o for o in info.value.outcomes}
    for rank in (0, 2):
        message = str(outcomes[rank].result)
        seconds = float(message.split()[0])
        assert seconds < 10 and "rank 1" in message, message


def _through_distributed_c10d(rank, world):
    """mmengine's calls: dist.distributed_c10d._get_default_group() and _rank_not_in_group(group)."""
    c10d = dist.distributed_c10d
    default = c10d._get_default_group()
    group = dist.new_group([0, 1])
    global_rank = 1
    if rank < 2:
        with pytest.warns(FutureWarning, match="get_global_rank"):
            global_rank = c10d._get_global_rank(group, 1)
    return (default is dist.group.WORLD, c10d._get_group_size(None), c10d._rank_not_in_group(group),
            c10d._rank_not_in_group(None), global_rank, isinstance(c10d._get_default_store(), dist.PrefixStore),
            c10d.all_reduce is dist.all_reduce,
            c10d._get_process_group_name(group) == (group.group_name if rank < 2 else "None"),
            c10d._get_process_group_name(None))


def test_distributed_c10d_path_and_the_private_helpers_libraries_call():
    assert set(dist.distributed_c10d.__all__) <= set(dist.__all__)
    with pytest.raises(ValueError, match="Default process group has not been initialized"):
        dist.distributed_c10d._get_default_group()
    results = run_ranks(_through_distributed_c10d, 3, backend="tcp")
    assert results == [(True, 3, False, False, 1, True, True, True, "None")] * 2 + [
        (True, 3, True, False, 1, True, True, True, "None")]


def _late_on_a_group_without_timeout(rank, world):
    dist.init_process_group("tcp", timeout=timedelta(seconds=2))
    group = dist.new_group([0, 1])  # no timeout: PyTorch's default (30 min), not the 2 s of the default group
    if rank == 1:
        time.sleep(4)
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    timeouts = (group.timeout, dist.new_group([0, 1], timeout=timedelta(seconds=7)).timeout)
    dist.destroy_process_group()
    return t.item(), timeouts


def test_a_group_made_without_a_timeout_waits_pytorchs_default_not_its_parents():
    results = run_ranks(_late_on_a_group_without_timeout, 2, timeout=60)
    assert results == [(2.0, (timedelta(minutes=30), timedelta(seconds=7)))] * 2
