"""A caller's own time limits hold: ``Work.wait(timeout)`` on a receive, ``barrier(timeout=...)``.

gloo raises at these limits (checked with torch 2.13: "Timed out waiting 1000ms for
recv operation"); torchdist used to wait for the group's timeout (30 minutes by
default) when the calling thread drove the receive or ran the barrier itself.
"""

import time
from datetime import timedelta

import pytest
import torch

import torchdist as dist
from torchdist.errors import DistBackendError
from torchdist.testing import run_ranks

BACKENDS = ["tcp", "shm", "auto"]


def _late_send(rank: int, world: int):
    dist.barrier()
    t = torch.zeros(2)
    if rank == 1:
        time.sleep(2.0)
        dist.send(torch.full((2,), 5.0), 0)
        return None
    work = dist.irecv(t, 1)
    start = time.monotonic()
    with pytest.raises(DistBackendError, match=r"recv did not complete within 0.500s; the operation is still"):
        work.wait(timedelta(seconds=0.5))
    gave_up = time.monotonic() - start
    work.wait()  # still in flight: it completes once rank 1 sends
    return gave_up, t.tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_recv_wait_gives_up_at_its_timeout_and_the_receive_stays_posted(backend: str) -> None:
    gave_up, got = run_ranks(_late_send, 2, backend=backend, timeout=60)[0]
    assert 0.5 <= gave_up < 1.5
    assert got == [5.0, 5.0]


def _late_barrier(rank: int, world: int):
    dist.barrier()
    if rank == world - 1:
        time.sleep(2.0)
    start = time.monotonic()
    try:
        dist.barrier(timeout=timedelta(seconds=0.5))
    except DistBackendError as exc:
        return str(exc), time.monotonic() - start
    # The late rank: everyone did arrive, so on shared memory its barrier may pass (the
    # others published their arrival before they gave up); the group is broken anyway.
    with pytest.raises(DistBackendError, match="aborted by rank|broken"):
        dist.all_reduce(torch.ones(1))
    return None, time.monotonic() - start


@pytest.mark.parametrize("backend", BACKENDS)
def test_barrier_timeout_names_the_rank_that_did_not_arrive(backend: str) -> None:
    results = run_ranks(_late_barrier, 3, backend=backend, timeout=60)
    for message, elapsed in results[:2]:
        assert "barrier (collective #1) timed out after 0.5s" in message
        assert "ranks [2] did not arrive" in message
        assert elapsed < 1.5
    late_message, _ = results[2]
    assert late_message is None or "barrier" in late_message


def _stalled_any_source(rank: int, world: int, backend: str):
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=1.5))
    dist.barrier()
    if rank == 1:
        time.sleep(3.0)
        return None
    try:
        dist.recv(torch.zeros(2), src=None)
    except DistBackendError as exc:
        return str(exc)
    return "received"


@pytest.mark.parametrize("backend", BACKENDS)
def test_any_source_receive_timeout_names_the_peers_it_waited_on(backend: str) -> None:
    # The message named "ranks []": an any-source receive names no peer of its own.
    message = run_ranks(_stalled_any_source, 2, args=(backend,), timeout=60)[0]
    assert "timed out" in message and "ranks [1]" in message, message


def _after_set_timeout(rank: int, world: int, simulate_hosts: bool):
    if simulate_hosts:  # rank 2 alone on a second host: the hierarchical all-reduce
        import os
        os.environ["TORCHDIST_HOST_ID"] = f"host-{rank // 2}"
    group = dist.new_group(list(range(world)))  # created with the default timeout (30 minutes)
    group.set_timeout(timedelta(seconds=1))
    assert group.timeout == timedelta(seconds=1)
    dist.all_reduce(torch.ones(1), group=group)
    if rank == world - 1:
        time.sleep(4)  # long after the others gave up: the break reaches us on our next op
        return None
    start = time.monotonic()
    with pytest.raises(DistBackendError, match="timed out after 1.0s"):
        dist.all_reduce(torch.ones(1 << 16), group=group)
    return time.monotonic() - start


@pytest.mark.parametrize("backend, world, simulate_hosts",
                         [("tcp", 2, False), ("shm", 2, False), ("auto", 3, True)])
def test_set_timeout_changes_the_timeout_of_later_ops(backend: str, world: int, simulate_hosts: bool) -> None:
    """``ProcessGroup.set_timeout`` as PyTorch's: the group's later ops give up at the new
    timeout (the backends kept the one they were created with)."""
    waited = run_ranks(_after_set_timeout, world, args=(simulate_hosts,), backend=backend, timeout=60)
    assert all(0.9 <= w < 3.0 for w in waited[:-1]), waited


def _one_rank_stalls(rank: int, world: int, op: str):
    dist.init_process_group("tcp", rank=rank, world_size=world, timeout=timedelta(seconds=2))
    dist.barrier()
    if rank == 1:
        time.sleep(6.0)  # alive, but far behind: the others' collective times out without it
        return None
    if rank == 2:
        time.sleep(0.3)  # rank 0 times out first, while rank 2 (which it waits on) still waits
    start = time.monotonic()
    with pytest.raises(DistBackendError) as info:
        if op == "barrier":
            dist.barrier()
        else:
            dist.all_to_all_single(torch.empty(4 << 10), torch.ones(4 << 10))
    return str(info.value), time.monotonic() - start


@pytest.mark.parametrize("op", ["barrier", "all_to_all_single"])
def test_every_waiter_names_the_stalled_rank_not_the_ranks_waiting_on_it(op: str) -> None:
    """At world 4 rank 0's barrier waits on rank 2, which waits on rank 1 (dissemination):
    rank 0 hears nothing from rank 2 in the op and, timing out first, named it (and its
    ABORT told ranks 2 and 3 so). Timed-out ranks now tell each other whom they wait on
    (WAITING notices), and every waiter follows the chain to rank 1."""
    results = run_ranks(_one_rank_stalls, 4, args=(op,), timeout=60)
    for rank, outcome in enumerate(results):
        if rank == 1:
            continue
        message, elapsed = outcome
        assert "ranks [1] did not arrive" in message, (rank, message)
        assert 2.0 <= elapsed < 4.0, (rank, elapsed, message)
