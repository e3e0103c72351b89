"""The "tcp" backend across real processes: every op against torch computed locally,
point-to-point matching, async progress, and every error path in bounded time.

Each test is one ``run_ranks`` call whose rank function runs many checks, since
starting ranks costs more than the checks. Exhaustive algorithm x size x world
combinations run in-process over the loopback transport (tests/algorithms);
here the point is the real sockets, the engine and the errors.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch

import torchdist
from torchdist._algorithms.comm import Scratch
from torchdist._process_group.backends.tcp import TcpBackend
from torchdist._process_group.reduce_op import ReduceOp, _make_nccl_premul_sum
from torchdist.errors import DistBackendError
from torchdist.testing import RanksFailed, run_ranks


def _backend(rank: int, world: int, timeout: float = 30.0, name: str = "test") -> TcpBackend:
    store = torchdist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, is_master=(rank == 0),
                               timeout=timedelta(seconds=30))
    return TcpBackend(torchdist.PrefixStore(name, store), rank, world, timedelta(seconds=timeout),
                      group_name=name)


def _data(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Deterministic per-rank data, small enough that integer products don't overflow."""
    g = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype is torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(1, 4, (n,), generator=g).to(dtype)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point:
        tol = 5e-2 if a.element_size() <= 2 else 1e-4
        return torch.allclose(a.double(), b.double(), rtol=tol, atol=tol)
    return torch.equal(a, b)


_REDUCE = {
    ReduceOp.SUM: lambda ts: torch.stack(ts).sum(0),
    ReduceOp.PRODUCT: lambda ts: torch.stack(ts).prod(0),
    ReduceOp.MIN: lambda ts: torch.stack(ts).min(0).values,
    ReduceOp.MAX: lambda ts: torch.stack(ts).max(0).values,
    ReduceOp.BAND: lambda ts: _fold(ts, torch.bitwise_and),
    ReduceOp.BOR: lambda ts: _fold(ts, torch.bitwise_or),
    ReduceOp.BXOR: lambda ts: _fold(ts, torch.bitwise_xor),
}


def _fold(ts, fn):
    out = ts[0]
    for t in ts[1:]:
        out = fn(out, t)
    return out


def _expected(op, inputs: list[torch.Tensor]) -> torch.Tensor:
    if inputs[0].dtype is torch.bool and op is ReduceOp.SUM:
        return _fold(inputs, torch.logical_or)
    if inputs[0].dtype is torch.bool and op is ReduceOp.PRODUCT:
        return _fold(inputs, torch.logical_and)
    wide = [t.double() if t.dtype.is_floating_point else t for t in inputs]
    return _REDUCE[op](wide).to(inputs[0].dtype)


def _ops_for(dtype: torch.dtype) -> list:
    if dtype is torch.bool:
        return [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR]
    if dtype.is_floating_point:
        return [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]
    return list(_REDUCE)


# -- every op, values against torch -----------------------------------------------------
def _every_op(rank: int, world: int, dtypes: list[torch.dtype], sizes: list[int]) -> list:
    torch.set_num_threads(1)
    backend = _backend(rank, world)
    digests = []
    for dtype in dtypes:
        for n in sizes:
            inputs = [_data(r, n, dtype) for r in range(world)]
            for op in _ops_for(dtype):
                t = inputs[rank].clone()
                backend.allreduce([t], op).wait()
                assert _close(t, _expected(op, inputs)), (dtype, n, op)
                digests.append(t)
                for root in {0, world - 1}:
                    t = inputs[rank].clone()
                    backend.reduce(t, root, op).wait()
                    if rank == root:
                        assert _close(t, _expected(op, inputs)), ("reduce", dtype, n, op, root)
            for root in range(world):
                t = inputs[rank].clone()
                backend.broadcast(t, root).wait()
                assert torch.equal(t, inputs[root])
            # all-gather, list form with per-rank sizes, and into one tensor
            sizes_per_rank = [n + r for r in range(world)]
            mine = _data(rank, sizes_per_rank[rank], dtype, 7)
            outs = [torch.empty(s, dtype=dtype) for s in sizes_per_rank]
            backend.allgather(outs, mine).wait()
            for r in range(world):
                assert torch.equal(outs[r], _data(r, sizes_per_rank[r], dtype, 7))
            out = torch.empty(world * n, dtype=dtype)
            backend.allgather_into_tensor(out, inputs[rank]).wait()
            assert torch.equal(out, torch.cat(inputs))
            # gather / scatter from the last rank
            root = world - 1
            outs = [torch.empty(n, dtype=dtype) for _ in range(world)] if rank == root else None
            backend.gather(outs, inputs[rank], root).wait()
            if rank == root:
                assert all(torch.equal(outs[r], inputs[r]) for r in range(world))
            out = torch.empty(n, dtype=dtype)
            chunks = [_data(r, n, dtype, 11) for r in range(world)]
            backend.scatter(out, chunks if rank == root else None, root).wait()
            assert torch.equal(out, chunks[rank])
            # reduce-scatter: list with per-rank sizes, and one tensor
            red = ReduceOp.SUM if dtype is not torch.bool else ReduceOp.BOR
            lists = [[_data(src, n + dst, dtype, 13 + dst) for dst in range(world)] for src in range(world)]
            out = torch.empty(n + rank, dtype=dtype)
            backend.reduce_scatter(out, lists[rank], red).wait()
            assert _close(out, _expected(red, [lists[src][rank] for src in range(world)]))
            big = [_data(r, world * n, dtype, 17) for r in range(world)]
            out = torch.empty(n, dtype=dtype)
            backend.reduce_scatter_tensor(out, big[rank].clone(), red).wait()
            assert _close(out, _expected(red, [b[rank * n:(rank + 1) * n] for b in big]))
            # all-to-all with uneven splits: rank i sends i + j + 1 elements to rank j
            ins = [torch.full((rank + j + 1,), rank * 10 + j).to(dtype) for j in range(world)]
            outs = [torch.empty(j + rank + 1, dtype=dtype) for j in range(world)]
            backend.alltoall(outs, ins).wait()
            for j in range(world):
                assert torch.equal(outs[j], torch.full((j + rank + 1,), j * 10 + rank).to(dtype))
    backend.barrier().wait()
    seq = backend.seq
    backend.shutdown()
    return digests, seq


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_op_matches_torch(world: int) -> None:
    dtypes = [torch.float32, torch.int64] if world in (1, 4) else [torch.float16, torch.bfloat16,
                                                                      torch.int32, torch.uint8, torch.bool]
    results = run_ranks(_every_op, world, args=(dtypes, [0, 1, 37]), timeout=90)
    for digests, seq in results:
        assert seq == results[0][1]
        for a, b in zip(digests, results[0][0]):  # bit-identical on every rank
            assert torch.equal(a, b)


def _large(rank: int, world: int) -> list:
    torch.set_num_threads(1)
    backend = _backend(rank, world)
    n = (3 << 20) + 3  # 12 MiB of float32: ring all-reduce, chain broadcast, odd chunks
    inputs = [_data(r, n, torch.float32) for r in range(world)]
    t = inputs[rank].clone()
    backend.allreduce([t], ReduceOp.SUM).wait()
    assert _close(t, _expected(ReduceOp.SUM, inputs))
    t2 = inputs[rank].clone()
    backend.allreduce([t2], ReduceOp.AVG).wait()
    assert _close(t2, _expected(ReduceOp.SUM, inputs) / world)
    t3 = inputs[rank].clone()
    backend.allreduce([t3], _make_nccl_premul_sum(0.5)).wait()
    assert _close(t3, _expected(ReduceOp.SUM, inputs) * 0.5)
    b = inputs[rank].clone()
    backend.broadcast(b, 1).wait()
    assert torch.equal(b, inputs[1])
    r = inputs[rank].clone()
    backend.reduce(r, 0, ReduceOp.MAX).wait()
    if rank == 0:
        assert _close(r, _expected(ReduceOp.MAX, inputs))
    out = torch.empty(n // world)
    m = out.numel()
    backend.reduce_scatter_tensor(out, inputs[rank][: m * world].clone(), ReduceOp.SUM).wait()
    assert _close(out, _expected(ReduceOp.SUM, [i[rank * m:(rank + 1) * m] for i in inputs]))
    backend.shutdown()
    return torch.cat([t, t2])  # SUM and AVG (divided where each piece is reduced): same bits everywhere


@pytest.mark.parametrize("world", [2, 3])
def test_large_tensors_are_bit_identical(world: int) -> None:
    results = run_ranks(_large, world, timeout=90)
    assert all(torch.equal(r, results[0]) for r in results)


# -- point to point -----------------------------------------------------------------------
def _p2p(rank: int, world: int) -> list:
    backend = _backend(rank, world)
    got = []
    if rank == 0:
        # Tag 2 is sent first but received last: messages wait, matched by tag.
        backend.send(torch.full((3,), 2.0), 1, 2).wait()
        backend.send(torch.full((3,), 1.0), 1, 1).wait()
        t = torch.zeros(5)
        for _ in range(world - 1):
            work = backend.recv(t, None, 9)  # any source
            work.wait()
            got.append((work.source_rank(), t[0].item()))
    else:
        if rank == 1:
            a, b = torch.zeros(3), torch.zeros(3)
            backend.recv(a, 0, 1).wait()
            backend.recv(b, 0, 2).wait()
            got += [a[0].item(), b[0].item()]
        # A p2p message interleaved with a collective does not disturb it.
        backend.send(torch.full((5,), float(rank)), 0, 9)
    t = torch.ones(4)
    backend.allreduce([t], ReduceOp.SUM).wait()
    assert t.tolist() == [float(world)] * 4
    # isend / irecv ring exchange, posted before waiting (batch_isend_irecv's pattern)
    out = torch.zeros(2)
    works = [backend.send(torch.full((2,), float(rank)), (rank + 1) % world, 0),
             backend.recv(out, (rank - 1) % world, 0)]
    for work in works:
        work.wait()
    got.append(out[0].item())
    seq = backend.seq
    backend.shutdown()
    return got, seq


def test_point_to_point_tags_any_source_and_interleaving() -> None:
    results = run_ranks(_p2p, 3, timeout=60)
    got0, seq0 = results[0]
    assert sorted(got0[:2]) == [(1, 1.0), (2, 2.0)]
    assert got0[2] == 2.0
    assert results[1][0] == [1.0, 2.0, 0.0]
    assert all(seq == seq0 == 1 for _, seq in results)  # p2p does not advance the sequence


# -- async progress and many ops ---------------------------------------------------------
def _async_and_many(rank: int, world: int) -> float:
    torch.set_num_threads(1)
    backend = _backend(rank, world)
    works, tensors = [], []
    for i in range(50):
        t = torch.full((1000 + i,), float(rank + i))
        tensors.append(t)
        works.append(backend.allreduce([t], ReduceOp.SUM))
    x = torch.randn(200, 200)
    for _ in range(5):
        x = x @ x / 200  # compute while the worker progresses the collectives
    for i, (w, t) in enumerate(zip(works, tensors)):
        w.wait()
        assert t[0].item() == sum(r + i for r in range(world))
    # 200 back-to-back mixed collectives, sync and async
    start = time.monotonic()
    for i in range(200):
        kind = i % 4
        t = torch.full((1 + i * 37,), float(rank))
        if kind == 0:
            backend.allreduce([t], ReduceOp.MAX).wait()
            assert t[0].item() == world - 1
        elif kind == 1:
            backend.broadcast(t, i % world).wait()
            assert t[0].item() == i % world
        elif kind == 2:
            out = torch.empty(world * t.numel())
            backend.allgather_into_tensor(out, t)  # not waited: the barrier below orders it
        else:
            backend.barrier().wait()
    backend.barrier().wait()
    backend.shutdown()
    return time.monotonic() - start


def test_async_overlap_and_200_mixed_collectives() -> None:
    assert all(t < 30 for t in run_ranks(_async_and_many, 3, timeout=60))


# -- errors: every rank raises, in bounded time --------------------------------------------
def _mismatch(rank: int, world: int, case: str) -> tuple[str, float]:
    backend = _backend(rank, world, timeout=20)
    backend.allreduce([torch.ones(4)], ReduceOp.SUM).wait()  # one good op first: seq 1 fails
    start = time.monotonic()
    t = torch.ones(4)
    try:
        if case == "kind":
            (backend.allreduce([t], ReduceOp.SUM) if rank == 0 else backend.broadcast(t, 0)).wait()
        elif case == "numel":
            backend.allreduce([torch.ones(4 + (rank == 1))], ReduceOp.SUM).wait()
        elif case == "root":
            # Every rank thinks it is the root, so nobody receives during the op itself:
            # a peer's message is caught while a rank's own send is under way (seq 1),
            # or, if that send left first, by the next collective (seq 2), at no extra cost.
            backend.broadcast(t, rank).wait()
            backend.barrier().wait()
        elif case == "redop":
            backend.allreduce([t], ReduceOp.SUM if rank == 0 else ReduceOp.MAX).wait()
        elif case == "dtype":
            backend.allreduce([torch.ones(4, dtype=torch.float32 if rank else torch.int32)], ReduceOp.SUM).wait()
    except DistBackendError as exc:
        elapsed = time.monotonic() - start
        try:  # the group is broken: later calls raise at once, with the cause
            backend.barrier().wait()
        except DistBackendError as later:
            assert later.__cause__ is not None and "broken" in str(later)
        else:
            raise AssertionError("a broken group accepted a new op")
        backend.shutdown()
        return str(exc), elapsed
    raise AssertionError(f"rank {rank}: mismatched {case} did not raise")


@pytest.mark.parametrize("case, words", [
    ("kind", ["ALLREDUCE", "BROADCAST"]),
    ("numel", ["numel=4", "numel=5"]),
    ("root", ["BROADCAST", "root="]),
    ("redop", ["op=SUM", "op=MAX"]),
    ("dtype", ["torch.int32", "torch.float32"]),
])
def test_mismatched_collectives_raise_on_every_rank(case: str, words: list[str]) -> None:
    for message, elapsed in run_ranks(_mismatch, 2, args=(case,), timeout=60):
        assert elapsed < 5, message
        seqs = ("sequence number 1", "sequence number 2") if case == "root" else ("sequence number 1",)
        assert "mismatch" in message and any(seq in message for seq in seqs), message
        assert all(w in message for w in words), message
        assert "rank 0" in message and "rank 1" in message, message


def _other_op_from_other_peers(rank: int, world: int, late_rank: int) -> tuple[str, float]:
    """Rank 0 broadcasts from rank 3 while the others all-reduce (recursive doubling): rank 0
    waits for its tree parent and gets the others' all-reduce messages; they wait for rank
    0's. ``late_rank`` starts last: rank 0 (the messages are parked when it posts its
    receive) or rank 1 (rank 0 has posted it when they arrive)."""
    backend = _backend(rank, world, timeout=20)
    backend.allreduce([torch.ones(4)], ReduceOp.SUM).wait()
    if rank == late_rank:
        time.sleep(0.5)
    start = time.monotonic()
    try:
        if rank == 0:
            backend.broadcast(torch.ones(2), 3).wait()
        else:
            backend.allreduce([torch.ones(2)], ReduceOp.SUM).wait()
    except DistBackendError as exc:
        backend.shutdown()
        return str(exc), time.monotonic() - start
    raise AssertionError(f"rank {rank}: the mismatched collective did not raise")


@pytest.mark.parametrize("late_rank", [0, 1])
def test_a_message_of_another_op_from_a_peer_nobody_waits_on_is_a_mismatch(late_rank: int) -> None:
    """Not a wait for the timeout: the message contradicts what this rank waits for from
    another peer (same sequence number, another op), so the ranks disagree."""
    for message, elapsed in run_ranks(_other_op_from_other_peers, 4, args=(late_rank,), timeout=60):
        assert elapsed < 5, message
        assert "collective mismatch at sequence number 1" in message, message
        assert "BROADCAST" in message and "ALLREDUCE" in message, message


def _two_roots(rank: int, world: int, late_rank: int) -> tuple[str, float]:
    """Rank 0 broadcasts 64 MB from itself, the others from rank 1: ranks 0 and 1 only
    send (each parks the other's message, while its own send, larger than the socket
    buffers can take, waits for room)."""
    backend = _backend(rank, world, timeout=20)
    if rank == late_rank:
        time.sleep(0.5)
    start = time.monotonic()
    try:
        backend.broadcast(torch.ones(1 << 24), 0 if rank == 0 else 1).wait()
    except DistBackendError as exc:
        backend.shutdown()
        return str(exc), time.monotonic() - start
    raise AssertionError(f"rank {rank}: the mismatched broadcast did not raise")


@pytest.mark.parametrize("world, late_rank", [(2, 0), (2, 1), (3, 1)])
def test_two_ranks_that_both_broadcast_as_root_is_a_mismatch(world: int, late_rank: int) -> None:
    """A message that contradicts a send still under way is a mismatch, at once, whether it
    arrives before that send is posted (``late_rank``) or after (before: every rank waited
    for the timeout). A rank that finds it mid-message cannot send the ABORT after the
    message: its peer may learn only that it broke the group (the connection ends)."""
    results = run_ranks(_two_roots, world, args=(late_rank,), timeout=60)
    for message, elapsed in results:
        assert elapsed < 5, message
        assert "collective mismatch at sequence number 0" in message or "lost rank" in message, message
    assert any("root=0" in message and "root=1" in message for message, _ in results), results


def _ping_pong(rank: int, world: int) -> int:
    backend = _backend(rank, world)
    t = torch.ones(4)
    for _ in range(2000):
        if rank == 0:
            backend.send(t, 1, 0).wait()
            backend.recv(t, 1, 0).wait()
        else:
            backend.recv(t, 0, 0).wait()
            backend.send(t, 0, 0).wait()
    backend.barrier().wait()
    left = len(backend._p2p)
    backend.shutdown()
    return left


def test_finished_point_to_point_ops_are_not_kept():
    """The backend keeps posted P2P ops for their deadlines; a synchronous one is dropped as
    soon as it is done (the periodic sweep alone left dozens behind after a loop)."""
    assert all(left < 20 for left in run_ranks(_ping_pong, 2, timeout=60))


def _killed(rank: int, world: int) -> tuple[str, float]:
    backend = _backend(rank, world, timeout=30)
    backend.barrier().wait()
    if rank == world - 1:
        os._exit(3)
    start = time.monotonic()
    try:
        for _ in range(50):
            backend.allreduce([torch.ones(1 << 16)], ReduceOp.SUM).wait()
    except DistBackendError as exc:
        return str(exc), time.monotonic() - start
    raise AssertionError("no error after a peer died")


def test_killed_rank_makes_the_others_raise_naming_it() -> None:
    with pytest.raises(RanksFailed) as info:
        run_ranks(_killed, 3, timeout=60)
    outcomes = info.value.outcomes
    assert info.value.failed_ranks == [2]
    for outcome in outcomes[:2]:
        message, elapsed = outcome.result
        assert elapsed < 5 and "rank 2" in message, message


def _stalled(rank: int, world: int) -> tuple[str, float]:
    backend = _backend(rank, world, timeout=1.0)
    backend.barrier().wait()
    if rank == 1:
        time.sleep(2.5)  # never joins in time
        return "", 0.0
    start = time.monotonic()
    try:
        backend.allreduce([torch.ones(8)], ReduceOp.SUM).wait()
    except DistBackendError as exc:
        return str(exc), time.monotonic() - start
    raise AssertionError("a stalled peer did not time out")


def test_stalled_rank_times_out_naming_op_and_rank() -> None:
    results = run_ranks(_stalled, 2, timeout=60)
    message, elapsed = results[0]
    assert 0.95 <= elapsed < 2.5, elapsed
    assert "timed out" in message and "allreduce" in message and "[1]" in message, message


def _async_recv_behind_collective(rank: int, world: int) -> float:
    backend = _backend(rank, world)
    t = torch.zeros(3)
    if rank == 0:
        # Both small async ops are queued without a worker wake-up; waiting on the recv
        # first must still get the all-reduce behind it done (the peer sends after it).
        w_recv = backend.recv(t, 1, 5)
        w_all = backend.allreduce([torch.ones(2)], ReduceOp.SUM)
        w_recv.wait()
        w_all.wait()
        assert w_recv.source_rank() == 1
    else:
        backend.allreduce([torch.ones(2)], ReduceOp.SUM).wait()
        backend.send(torch.full((3,), 4.0), 0, 5).wait()
    backend.shutdown()
    return t[0].item()


def test_waiting_on_an_irecv_queued_before_a_collective() -> None:
    assert run_ranks(_async_recv_behind_collective, 2, timeout=30)[0] == 4.0


def _scratch_kept(rank: int, world: int) -> list[int]:
    group = torchdist.new_group(list(range(world)), backend="tcp")
    backend, kept = group.backend, []
    for nbytes in (16 << 20, 4 * Scratch.KEEP_BYTES):  # (an all-reduce at world 2 needs half its size)
        t = torch.ones(nbytes // 4)
        torchdist.all_reduce(t, group=group)
        assert torch.equal(t[:3], torch.full((3,), float(world)))
        kept.append(backend._scratch.buffer.numel())
    torchdist.destroy_process_group(group)  # the user may still hold the destroyed group
    kept.append(backend._scratch.buffer.numel())
    return kept


def test_scratch_memory_is_bounded_and_goes_with_the_group() -> None:
    for small, huge, destroyed in run_ranks(_scratch_kept, 2, backend="tcp", timeout=60):
        assert 0 < small <= 16 << 20 and huge == small and destroyed == 0
