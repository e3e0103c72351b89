"""Async ops progress without the caller, and point-to-point ops do not queue behind them.

torch.distributed's gloo runs every op on background threads and posts a send or
receive at once. Programs rely on that; each body below completes under gloo
(checked with torch 2.13) and, before torchdist matched it, hung on torchdist
until the group timeout:

- an async collective on group A, then a blocking collective on group B that a
  peer joins only after finishing A: the async op must run although nobody waits
  on it yet;
- async collectives issued in opposite orders on two groups by two ranks;
- an async collective, then a send that the peer needs before it joins the
  collective: the send must not wait for the collective issued before it, and
  the peer must read past the collective's message that arrived first.
"""

import time
from datetime import timedelta

import pytest
import torch

import torchdist as dist
from torchdist.testing import run_ranks

BACKENDS = ["tcp", "shm", "auto"]
#: The group timeout of these bodies: a hang becomes an error well inside the run's timeout.
_TIMEOUT = timedelta(seconds=10)


def _groups():
    return dist.new_group([0, 1], timeout=_TIMEOUT), dist.new_group([0, 1], timeout=_TIMEOUT)


def _async_then_other_group(rank: int, world: int, numel: int):
    a, b = _groups()
    t = torch.full((numel,), float(rank + 1))
    u = torch.full((numel,), float(rank + 1))
    if rank == 0:
        work = dist.all_reduce(t, group=a, async_op=True)
        dist.all_reduce(u, group=b)  # rank 1 gets here only once A is done
        work.wait()
    else:
        dist.all_reduce(t, group=a)
        dist.all_reduce(u, group=b)
    return t[0].item(), u[0].item()


def _opposite_orders(rank: int, world: int, numel: int):
    a, b = _groups()
    t = torch.full((numel,), float(rank + 1))
    u = torch.full((numel,), float(rank + 1))
    first, second = (a, b) if rank == 0 else (b, a)
    x, y = (t, u) if rank == 0 else (u, t)
    work = dist.all_reduce(x, group=first, async_op=True)
    dist.all_reduce(y, group=second)
    work.wait()
    return t[0].item(), u[0].item()


def _async_then_send(rank: int, world: int, numel: int):
    dist.barrier()
    t = torch.full((numel,), float(rank + 1))
    got = torch.zeros(numel)
    if rank == 0:
        work = dist.all_reduce(t, async_op=True)
        dist.send(torch.full((numel,), 7.0), 1)  # rank 1 joins the all-reduce after receiving this
        work.wait()
    else:
        dist.recv(got, 0)
        dist.all_reduce(t)
    return t[0].item(), got[0].item()


def _async_all_to_all_then_send(rank: int, world: int, numel: int):
    """all-to-all travels as messages (TCP sockets, shared-memory rings): rank 0's part
    reaches rank 1 *before* the send, in the same stream, and rank 1 must get past it."""
    dist.barrier()
    inp = torch.full((2 * numel,), float(rank + 1))
    out = torch.zeros(2 * numel)
    got = torch.zeros(numel)
    if rank == 0:
        work = dist.all_to_all_single(out, inp, async_op=True)
        time.sleep(0.2)  # the worker sends this rank's part of the all-to-all first
        dist.send(torch.full((numel,), 7.0), 1)
        work.wait()
    else:
        dist.recv(got, 0)
        dist.all_to_all_single(out, inp)
    return out.tolist()[::numel], got[0].item()


def _async_then_recv(rank: int, world: int, numel: int):
    dist.barrier()
    t = torch.full((numel,), float(rank + 1))
    got = torch.zeros(numel)
    if rank == 0:
        work = dist.all_reduce(t, async_op=True)
        dist.recv(got, 1)  # rank 1 sends only after the all-reduce
        work.wait()
    else:
        dist.all_reduce(t)
        dist.send(torch.full((numel,), 7.0), 0)
    return t[0].item(), got[0].item()


@pytest.mark.parametrize("numel", [4, 1 << 18])
@pytest.mark.parametrize("backend", BACKENDS)
def test_async_collective_runs_while_the_caller_blocks_on_another_group(backend: str, numel: int) -> None:
    assert run_ranks(_async_then_other_group, 2, args=(numel,), backend=backend, timeout=60) == [(3.0, 3.0)] * 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_collectives_in_opposite_orders_on_two_groups(backend: str) -> None:
    assert run_ranks(_opposite_orders, 2, args=(4,), backend=backend, timeout=60) == [(3.0, 3.0)] * 2


@pytest.mark.parametrize("numel", [4, 1 << 18])
@pytest.mark.parametrize("backend", BACKENDS)
def test_send_does_not_wait_for_an_async_collective_issued_before_it(backend: str, numel: int) -> None:
    results = run_ranks(_async_then_send, 2, args=(numel,), backend=backend, timeout=60)
    assert results == [(3.0, 0.0), (3.0, 7.0)]


@pytest.mark.parametrize("numel", [4, 1 << 18])
@pytest.mark.parametrize("backend", BACKENDS)
def test_send_behind_a_collective_message_in_the_same_stream(backend: str, numel: int) -> None:
    results = run_ranks(_async_all_to_all_then_send, 2, args=(numel,), backend=backend, timeout=60)
    assert results == [([1.0, 2.0], 0.0), ([1.0, 2.0], 7.0)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_recv_posted_behind_an_async_collective_completes(backend: str) -> None:
    results = run_ranks(_async_then_recv, 2, args=(4,), backend=backend, timeout=60)
    assert results == [(3.0, 7.0), (3.0, 0.0)]


def _unwaited_async_op_completes(rank: int, world: int):
    """Nobody waits on rank 0's async op; rank 1's blocking one still returns."""
    t = torch.full((4,), float(rank + 1))
    start = time.monotonic()
    if rank == 0:
        work = dist.all_reduce(t, async_op=True)
        while not work.is_completed() and time.monotonic() - start < 10:  # polls; never calls wait()
            time.sleep(0.001)
        done = work.is_completed()
    else:
        dist.all_reduce(t)
        done = True
    return done, t[0].item()


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_op_completes_when_only_polled(backend: str) -> None:
    assert run_ranks(_unwaited_async_op_completes, 2, backend=backend, timeout=60) == [(True, 3.0)] * 2


def _collective_inside_future_callback(rank: int, world: int, mode: str):
    """A Work future's callback runs another collective and waits on it, as callbacks
    written for PyTorch do (its PowerSGD hook waits on a future inside one). Rank 0's
    op starts before its peers arrive, so it completes on the engine's worker."""
    dist.barrier()
    if rank != 0:
        time.sleep(0.2)

    def callback(future):
        t = future.value()[0].clone()
        if mode == "sync":
            dist.all_reduce(t)
            return t
        return dist.all_reduce(t, async_op=True).get_future().wait()[0]
    x = torch.tensor([float(rank + 1)])
    return dist.all_reduce(x, async_op=True).get_future().then(callback).wait().item()


@pytest.mark.parametrize("backend", ["tcp", "shm"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_future_callback_may_run_and_wait_on_collectives(backend: str, mode: str) -> None:
    world = 3
    total = world * sum(range(1, world + 1))
    assert run_ranks(_collective_inside_future_callback, world, args=(mode,), backend=backend,
                     timeout=60) == [total] * world


def _coalesced(rank: int, world: int):
    outputs = [[torch.zeros(1), torch.zeros(2)] for _ in range(world)]
    inputs = [torch.tensor([float(rank)]), torch.full((2,), 10.0 + rank)]
    assert dist.all_gather_coalesced(outputs, inputs) is None  # synchronous: small parts run when waited on
    gathered = [[t.tolist() for t in per_rank] for per_rank in outputs]
    future = dist.all_gather_coalesced(outputs, inputs, async_op=True)
    nested = [[t.tolist() for t in per_rank] for per_rank in future.wait()]
    reduced = dist.all_reduce_coalesced([torch.ones(1), torch.ones(3)], async_op=True)
    return gathered, nested, [t.tolist() for t in reduced.then(lambda f: f.value()).wait()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_coalesced_ops_complete_and_return_futures_as_pytorch(backend: str) -> None:
    world = 3
    want = [[[float(r)], [10.0 + r] * 2] for r in range(world)]
    for gathered, nested, reduced in run_ranks(_coalesced, world, backend=backend, timeout=60):
        assert gathered == nested == want
        assert reduced == [[3.0], [3.0] * 3]


def _irecv_after_the_message_arrived(rank: int, world: int, numel: int):
    """Rank 1's message is in rank 0's socket (or ring) before rank 0 posts its irecv."""
    if rank == 1:
        dist.isend(torch.full((numel,), 7.0), dst=0).wait()
        return None
    time.sleep(0.5)
    got = torch.zeros(numel)
    dist.irecv(got, src=1).wait()
    return got[0].item(), got[-1].item()


@pytest.mark.parametrize("numel", [4, 1 << 20])
@pytest.mark.parametrize("backend", BACKENDS)
def test_irecv_posted_after_its_message_arrived_completes(backend: str, numel: int) -> None:
    # tcp: the receive matched a message half read at once, so the transport had no
    # *posted* receive left, and the worker slept while the rest sat in the socket.
    assert run_ranks(_irecv_after_the_message_arrived, 2, args=(numel,), backend=backend,
                     timeout=60)[0] == (7.0, 7.0)
