"""The "shm" and "auto" backends across real processes: the TCP backend's whole test matrix
(every op and dtype against torch, world sizes 1-4, large tensors, point to point,
async ops, mismatches, a killed rank, a stalled rank), plus what is specific to
shared memory: a rank SIGKILLed while its peers wait on shared counters, no
files left in /dev/shm, and a simulated two-host job on the hierarchical path.

The rank functions of tests/backends/test_tcp_backend.py build their backend with
its module-level ``_backend``; ``_on`` swaps that factory for the backend under
test inside each rank process, so the same bodies run on every backend.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import signal
import sys
import time
from datetime import timedelta

import pytest
import torch

import torchdist
from torchdist._process_group.backends.auto import AutoBackend, HierarchicalBackend
from torchdist._process_group.backends.shm import ShmBackend
from torchdist._process_group.reduce_op import ReduceOp
from torchdist._transport.shm_segment import PREFIX, shm_dir, supported
from torchdist.errors import DistBackendError
from torchdist.testing import RanksFailed, run_ranks

pytestmark = pytest.mark.skipif(supported() is not None, reason=str(supported()))

_TCP_TESTS = pathlib.Path(__file__).parents[1] / "backends" / "test_tcp_backend.py"
_BACKENDS = {"shm": ShmBackend, "auto": AutoBackend}


def _tcp_tests():
    """tests/backends/test_tcp_backend.py as a module (loaded once per process)."""
    module = sys.modules.get("_tcp_backend_tests")
    if module is None:
        spec = importlib.util.spec_from_file_location("_tcp_backend_tests", _TCP_TESTS)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


def _on(rank: int, world: int, backend: str, name: str, *args):
    """Run the TCP tests' rank function ``name`` with ``backend`` instead of TcpBackend."""
    tests = _tcp_tests()

    def make(rank: int, world: int, timeout: float = 30.0, group: str = "test"):
        store = torchdist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, is_master=(rank == 0),
                                   timeout=timedelta(seconds=30))
        return _BACKENDS[backend](torchdist.PrefixStore(group, store), rank, world, timedelta(seconds=timeout),
                                  group_name=group)
    tests._backend = make
    return getattr(tests, name)(rank, world, *args)


def _ours() -> set[str]:
    return {n for n in os.listdir(shm_dir()) if n.startswith(PREFIX)}


# -- the TCP backend's matrix --------------------------------------------------------------
@pytest.mark.parametrize("backend", ["shm", "auto"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_op_matches_torch(backend: str, world: int) -> None:
    dtypes = [torch.float32, torch.int64] if world in (1, 4) else [torch.float16, torch.bfloat16,
                                                                      torch.int32, torch.uint8, torch.bool]
    results = run_ranks(_on, world, args=(backend, "_every_op", dtypes, [0, 1, 37]),
                        timeout=120)
    for digests, seq in results:
        assert seq == results[0][1]
        for a, b in zip(digests, results[0][0]):  # bit-identical on every rank
            assert torch.equal(a, b)


@pytest.mark.parametrize("world", [2, 3])
def test_every_op_with_regions_smaller_than_a_small_op(world: int) -> None:
    """With 4 KiB regions (TORCHDIST_SHM_CHUNK) ops below SMALL_BYTES that do not fit one
    region take the chunked paths: sizes around the region's edge, for every op."""
    results = run_ranks(_on, world, args=("shm", "_every_op", [torch.float32], [1000, 1024, 1100, 3000]),
                        env={"TORCHDIST_SHM_CHUNK": "4096"}, timeout=120)
    for digests, seq in results:
        assert seq == results[0][1]
        for a, b in zip(digests, results[0][0]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("world", [2, 3])
def test_large_tensors_are_bit_identical(world: int) -> None:
    results = run_ranks(_on, world, args=("shm", "_large"), timeout=120)
    assert all(torch.equal(r, results[0]) for r in results)


def test_point_to_point_tags_any_source_and_interleaving() -> None:
    results = run_ranks(_on, 3, args=("shm", "_p2p"), timeout=60)
    got0, seq0 = results[0]
    assert sorted(got0[:2]) == [(1, 1.0), (2, 2.0)]
    assert got0[2] == 2.0
    assert results[1][0] == [1.0, 2.0, 0.0]
    assert all(seq == seq0 == 1 for _, seq in results)


def test_async_overlap_and_200_mixed_collectives() -> None:
    assert all(t < 30 for t in run_ranks(_on, 3, args=("shm", "_async_and_many"), timeout=90))


# -- errors --------------------------------------------------------------------------------
@pytest.mark.parametrize("case, words", [
    ("kind", ["ALLREDUCE", "BROADCAST"]),
    ("numel", ["numel=4", "numel=5"]),
    ("root", ["BROADCAST", "root=0", "root=1"]),
    ("redop", ["op=SUM", "op=MAX"]),
    ("dtype", ["torch.int32", "torch.float32"]),
])
def test_mismatched_collectives_raise_on_every_rank(case: str, words: list[str]) -> None:
    # Shared memory compares fingerprints at the op's first step: even the "root" case
    # (every rank thinks it is the broadcast's root) is caught at its own seq.
    for message, elapsed in run_ranks(_on, 2, args=("shm", "_mismatch", case), timeout=60):
        assert elapsed < 5, message
        assert "mismatch" in message and "sequence number 1" in message, message
        assert all(w in message for w in words), message
        assert "rank 0" in message and "rank 1" in message, message


def test_killed_rank_makes_the_others_raise_naming_it() -> None:
    before = _ours()
    with pytest.raises(RanksFailed) as info:
        run_ranks(_on, 3, args=("shm", "_killed"), timeout=60)
    assert info.value.failed_ranks == [2]
    for outcome in info.value.outcomes[:2]:
        message, elapsed = outcome.result
        assert elapsed < 5 and "rank 2" in message, message
    assert _ours() <= before


def _stalled(rank: int, world: int, size: int) -> tuple[str, float]:
    """Rank 1 never joins the second all-reduce in time (group timeout 1.5 s)."""
    torchdist.init_process_group("shm", timeout=timedelta(seconds=1.5))
    torchdist.all_reduce(torch.ones(size))
    if rank == 1:
        time.sleep(3.5)
        return "", 0.0
    start = time.monotonic()
    try:
        torchdist.all_reduce(torch.ones(size))
    except DistBackendError as exc:
        return str(exc), time.monotonic() - start
    raise AssertionError("a stalled peer did not time out")


@pytest.mark.parametrize("size", [2, 1 << 20])
def test_stalled_rank_times_out_naming_op_and_rank(size: int) -> None:
    results = run_ranks(_stalled, 2, args=(size,), timeout=60)
    message, elapsed = results[0]
    assert 1.4 <= elapsed < 3.5, elapsed
    assert "timed out" in message and "allreduce" in message and "[1]" in message, message


def _sigkilled_while_waiting(rank: int, world: int, size: int) -> tuple[str, float]:
    """The last rank SIGKILLs itself while the others wait on shared counters."""
    torch.set_num_threads(1)
    torchdist.all_reduce(torch.ones(size))
    if rank == world - 1:
        time.sleep(0.2)  # the others are blocked in the next all-reduce by now
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        torchdist.all_reduce(torch.ones(size))
    except DistBackendError as exc:
        return str(exc), time.monotonic() - start
    raise AssertionError("no error after a peer was killed")


@pytest.mark.parametrize("size", [2, 1 << 20])
def test_sigkilled_rank_is_noticed_within_seconds_and_leaks_nothing(size: int) -> None:
    before = _ours()
    with pytest.raises(RanksFailed) as info:
        run_ranks(_sigkilled_while_waiting, 3, args=(size,), backend="shm", timeout=60)
    assert info.value.failed_ranks == [2]
    for outcome in info.value.outcomes[:2]:
        message, elapsed = outcome.result
        assert elapsed < 5 and "rank 2" in message and "all_reduce" in message.replace("allreduce", "all_reduce"), \
            message
    assert _ours() <= before, _ours() - before


def _killed_while_received_from(rank: int, world: int, how: str) -> tuple[str, float]:
    """The last rank SIGKILLs itself while rank 0 waits for it in a receive or a
    monitored barrier (the others, if any, wait in the barrier too)."""
    torchdist.barrier()
    if rank == world - 1:
        time.sleep(0.3)  # the others are waiting by now
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        if how == "monitored_barrier":
            torchdist.monitored_barrier()
        else:
            torchdist.recv(torch.empty(4), src=None if how == "recv(any)" else world - 1)
    except DistBackendError as exc:
        return str(exc), time.monotonic() - start
    raise AssertionError("no error after a peer was killed")


@pytest.mark.parametrize("how, world", [("recv", 2), ("recv(any)", 2), ("monitored_barrier", 3)])
@pytest.mark.parametrize("backend", ["shm", "auto"])
def test_a_rank_killed_while_received_from_is_noticed_within_seconds(backend: str, how: str, world: int) -> None:
    # Only a transfer naming the dead rank looked at its liveness: a receive from any
    # source, and a receive sliced into short waits (a blocking recv, monitored_barrier's
    # receives), waited for the group's whole timeout.
    with pytest.raises(RanksFailed) as info:
        run_ranks(_killed_while_received_from, world, args=(how,), backend=backend, timeout=60)
    assert info.value.failed_ranks == [world - 1]
    message, elapsed = info.value.outcomes[0].result
    assert elapsed < 5, (elapsed, message)
    assert f"rank {world - 1}" in message or f"ranks [{world - 1}]" in message, message
    assert "gone" in message, message


# -- auto: one host, several hosts -----------------------------------------------------------
def _kind_of_backend(rank: int, world: int) -> str:
    return type(torchdist.group.WORLD.backend).__name__


def test_auto_on_one_host_is_shared_memory_and_gloo_is_its_alias() -> None:
    assert run_ranks(_kind_of_backend, 2, backend="auto") == ["ShmBackend"] * 2
    assert run_ranks(_kind_of_backend, 2, backend="gloo") == ["ShmBackend"] * 2


def _on_two_simulated_hosts(rank: int, world: int, timeout_s: float, store_timeout_s: float = 60):
    """This rank's auto backend with hosts {0, 1} and {2, 3} (a HierarchicalBackend)."""
    os.environ["TORCHDIST_HOST_ID"] = f"simulated-host-{rank // 2}"
    torch.set_num_threads(1)
    store = torchdist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, is_master=(rank == 0),
                               timeout=timedelta(seconds=store_timeout_s))
    backend = AutoBackend(torchdist.PrefixStore("pg", store), rank, world, timedelta(seconds=timeout_s),
                          group_name="pg")
    assert isinstance(backend, HierarchicalBackend)
    return backend


def _two_hosts(rank: int, world: int) -> list:
    backend = _on_two_simulated_hosts(rank, world, 30, 30)
    out = []
    for n in (1, 1000, (1 << 20) + 3):
        inputs = [torch.arange(n, dtype=torch.float64) * (r + 1) for r in range(world)]
        for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG):
            t = inputs[rank].clone()
            backend.allreduce([t], op).wait()
            stacked = torch.stack(inputs)
            expected = {ReduceOp.SUM: stacked.sum(0), ReduceOp.MAX: stacked.max(0).values,
                        ReduceOp.AVG: stacked.sum(0) / world}[op]
            assert torch.allclose(t, expected), (n, op)
            out.append(t)
    works = [backend.allreduce([torch.full((10,), float(rank + i))], ReduceOp.SUM) for i in range(5)]
    for i, work in enumerate(works):
        work.wait()
        assert work.result()[0][0].item() == sum(r + i for r in range(world))
    t = torch.full((5,), float(rank))
    backend.broadcast(t, 3).wait()
    assert t.tolist() == [3.0] * 5
    gathered = [torch.empty(2) for _ in range(world)]
    backend.allgather(gathered, torch.full((2,), float(rank))).wait()
    assert [g[0].item() for g in gathered] == [0.0, 1.0, 2.0, 3.0]
    backend.barrier().wait()
    leader = backend.leaders is not None
    backend.shutdown()
    return out, leader


def test_simulated_two_hosts_take_the_hierarchical_path() -> None:
    results = run_ranks(_two_hosts, 4, timeout=90)
    assert [leader for _, leader in results] == [True, False, True, False]
    for out, _ in results:
        for a, b in zip(out, results[0][0]):
            assert torch.equal(a, b)


def _p2p_beside_hierarchical_allreduce(rank: int, world: int, when: str) -> float:
    """Two simulated hosts {0, 1} and {2, 3}. Rank 3 sends rank 2 (its host's leader) 8 MiB,
    more than the sockets buffer, and all-reduces asynchronously; rank 2 takes the message
    before it joins the all-reduce. ``before``: the send is posted first; ``during``: after
    the all-reduce, whose op then waits in the host's reduce for rank 2. Either way rank 3's
    send must keep moving while its all-reduce waits in a sub-group, as gloo's does."""
    backend = _on_two_simulated_hosts(rank, world, 20)
    message = torch.arange(8 << 20, dtype=torch.uint8)
    x = torch.full((1000,), float(rank))
    start = time.monotonic()
    if rank == 3:
        if when == "before":
            sent = backend.send(message, 2, 7, async_op=True)
            reduced = backend.allreduce([x], ReduceOp.SUM, async_op=True)
        else:
            reduced = backend.allreduce([x], ReduceOp.SUM, async_op=True)
            time.sleep(0.5)  # the all-reduce is waiting in the host's reduce by now
            sent = backend.send(message, 2, 7, async_op=True)
        sent.wait()
        reduced.wait()
    elif rank == 2:
        received = torch.zeros_like(message)
        backend.recv(received, 3, 7, async_op=True).wait()
        assert torch.equal(received, message)
        backend.allreduce([x], ReduceOp.SUM).wait()
    else:
        backend.allreduce([x], ReduceOp.SUM).wait()
    assert x.tolist() == [6.0] * 1000
    elapsed = time.monotonic() - start
    backend.shutdown()
    return elapsed


@pytest.mark.parametrize("when", ["before", "during"])
def test_point_to_point_moves_while_a_hierarchical_allreduce_waits(when: str) -> None:
    for rank, elapsed in enumerate(run_ranks(_p2p_beside_hierarchical_allreduce, 4, args=(when,), timeout=90)):
        assert elapsed < 10, (rank, elapsed)


def _hierarchical_failure(rank: int, world: int, case: str) -> tuple[str, float]:
    """Two simulated hosts {0, 1} and {2, 3}. ``dies``: rank 3 exits in the middle of an
    all-reduce; ``mismatch``: rank 2 calls broadcast where the others all-reduce. The
    survivors keep their processes alive afterwards, so nobody learns of the failure
    from a closed connection alone."""
    backend = _on_two_simulated_hosts(rank, world, 20)
    t = torch.ones(1 << 20)
    backend.allreduce([t]).wait()  # everyone is connected and past setup
    if case == "dies" and rank == 3:
        os._exit(0)
    start = time.monotonic()
    try:
        if case == "mismatch" and rank == 2:
            backend.broadcast(t, 0).wait()
        else:
            backend.allreduce([t]).wait()
    except DistBackendError as exc:
        outcome = str(exc), time.monotonic() - start
    else:
        raise AssertionError(f"rank {rank}: the op succeeded")
    time.sleep(3)  # stay alive while the others find out
    return outcome


@pytest.mark.parametrize("case", ["dies", "mismatch"])
def test_hierarchical_failure_reaches_every_rank_within_seconds(case: str) -> None:
    """A failure in one sub-group (shared memory in a host, TCP between hosts) breaks the
    others too, so every rank raises promptly instead of at the group timeout (20 s)."""
    outcomes = run_ranks(_hierarchical_failure, 4, args=(case,), timeout=90) if case == "mismatch" else None
    if outcomes is None:
        with pytest.raises(RanksFailed) as info:
            run_ranks(_hierarchical_failure, 4, args=(case,), timeout=90, grace=30)
        outcomes = [o.result for o in info.value.outcomes[:3]]
    for rank, (message, elapsed) in enumerate(outcomes):
        assert elapsed < 5, (rank, elapsed, message)
        if case == "mismatch":
            assert "BROADCAST" in message or "broadcast" in message, (rank, message)
        else:
            assert "rank 3" in message, (rank, message)


def _shm_across_hosts(rank: int, world: int) -> str:
    os.environ["TORCHDIST_HOST_ID"] = f"simulated-host-{rank}"
    store = torchdist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, is_master=(rank == 0),
                               timeout=timedelta(seconds=30))
    try:
        ShmBackend(torchdist.PrefixStore("pg", store), rank, world, timedelta(seconds=10), group_name="pg")
    except DistBackendError as exc:
        message = str(exc)
    else:
        raise AssertionError("shm accepted ranks on two hosts")
    # The store lives in rank 0's process: it stays until every rank is done with it
    # (rank 0 can fail first and exit while rank 1 still reads the host keys).
    store.add("finished", 1)
    while rank == 0 and store.add("finished", 0) < world:
        time.sleep(0.01)
    return message


def test_shm_across_hosts_is_a_clear_error_naming_them() -> None:
    for message in run_ranks(_shm_across_hosts, 2, timeout=60):
        assert "one host" in message and "simulated-host-0" in message and "simulated-host-1" in message, message
        assert "auto" in message


def _p2p_pending_across_a_collective(rank: int, world: int) -> float:
    """Rank 1's 8 MiB send outgrows the ring while rank 0 already waits in the all-reduce:
    rank 0's step wait must keep draining the ring, or both wait forever."""
    big = torch.full((2 << 20,), float(rank))
    if rank == 0:
        work = torchdist.irecv(big, src=1)
        t = torch.ones(1 << 18)
        torchdist.all_reduce(t)
        work.wait()
        assert big[0].item() == 1.0 and big[-1].item() == 1.0
        return t[0].item()
    torchdist.send(big, dst=0)
    t = torch.ones(1 << 18)
    torchdist.all_reduce(t)
    return t[0].item()


def test_pending_p2p_progresses_while_a_collective_waits() -> None:
    assert run_ranks(_p2p_pending_across_a_collective, 2, backend="shm", timeout=60) == [2.0, 2.0]


def _spare_cores(rank: int, world: int, cores: int) -> tuple[bool, list[str], list[float]]:
    """On a host faked to have ``cores`` CPUs: does a large async all-reduce run on the
    engine's worker (which does not poll, see Steps._wait) while the caller goes on?"""
    import threading

    from torchdist._algorithms import shm_direct
    from torchdist._transport.thread_roles import on_worker_thread

    os.sched_getaffinity = lambda pid: set(range(cores))
    torchdist.init_process_group("shm")
    try:
        threads = []
        run = shm_direct.allreduce

        def recording(comm, flat, *args):
            threads.append("worker" if on_worker_thread() else threading.current_thread().name)
            run(comm, flat, *args)
        shm_direct.allreduce = recording
        backend = torchdist.group.WORLD.backend
        big = torch.full((1 << 18,), float(rank + 1))  # 1 MiB: over the wake-up size
        torchdist.barrier()  # both ranks are inside the next op soon: inline would be allowed
        time.sleep(0.3 * rank)  # rank 0 is inside, on its worker, by then (even under load)
        work = torchdist.all_reduce(big, async_op=True)
        time.sleep(0.2)  # "compute": a wait right away would run a queued op itself
        work.wait()
        small = torch.ones(4)
        torchdist.all_reduce(small)  # synchronous: always on the caller's thread
        return backend.async_overlaps_compute, threads, [big[0].item(), big[-1].item(), small[0].item()]
    finally:
        torchdist.destroy_process_group()


@pytest.mark.parametrize("cores, on_worker", [(64, True), (2, False)], ids=["spare-cores", "no-spare-core"])
def test_large_async_ops_go_to_the_worker_only_on_hosts_with_spare_cores(cores: int, on_worker: bool) -> None:
    for rank, (overlaps, threads, values) in enumerate(run_ranks(_spare_cores, 2, args=(cores,), timeout=60)):
        assert overlaps is on_worker
        assert values == [3.0, 3.0, 2.0]
        assert threads[-1] == "MainThread", threads
        if on_worker:
            assert threads[0] == "worker", threads
        elif rank == 1:  # the later rank finds its peer inside the op and runs it itself
            assert threads[0] == "MainThread", threads


# -- reading the peers' tensors in their processes (_transport/cross_memory) --------------------
def _reading_peers(rank: int, world: int, sizes: list[int]) -> tuple[list | None, int, list[torch.Tensor]]:
    """Every all-reduce op and a few dtypes over ``sizes``, every one reading the peers'
    tensors if the group can, against torch; returns the group's pids, how many
    all-reduces read the peers' memory, and the results."""
    from torchdist._algorithms import shm_direct

    shm_direct.CROSS_MIN_BYTES = 1
    tests = _tcp_tests()
    reads = []
    run = shm_direct._cross_allreduce

    def counting(*args):
        reads.append(1)
        run(*args)
    shm_direct._cross_allreduce = counting
    torch.set_num_threads(1)
    torchdist.init_process_group("shm")
    try:
        backend = torchdist.group.WORLD.backend
        results = []
        for dtype in (torch.float32, torch.float16, torch.int64, torch.bool):
            for n in sizes:
                inputs = [tests._data(r, n, dtype) for r in range(world)]
                for op in tests._ops_for(dtype) + ([ReduceOp.AVG] if dtype.is_floating_point else []):
                    t = inputs[rank].clone()
                    torchdist.all_reduce(t, op)
                    want = (tests._expected(ReduceOp.SUM, inputs) / world).to(dtype) if op == ReduceOp.AVG \
                        else tests._expected(op, inputs)
                    assert tests._close(t, want), (dtype, n, op)
                    results.append(t)
        strided = tests._data(rank, 2 * 5000, torch.float32)[::2]  # not contiguous: read from a copy
        torchdist.all_reduce(strided)
        results.append(strided)
        return backend._transport.board.pids, len(reads), results
    finally:
        torchdist.destroy_process_group()


@pytest.mark.parametrize("world", [3, 4])
def test_allreduce_reading_the_peers_tensors_matches_torch_bit_identically(world: int) -> None:
    """Every all-reduce at p >= 3 reads the peers' tensors with process_vm_readv: every
    reduce op, slices empty (n < p), uneven and over one piece."""
    outcomes = run_ranks(_reading_peers, world, args=([1, 37, 70001],), timeout=120)
    pids = outcomes[0][0]
    assert pids is not None and len(set(pids)) == world
    for pids_seen, reads, results in outcomes:
        assert pids_seen == pids and reads == len(results)
        assert all(torch.equal(a, b) for a, b in zip(results, outcomes[0][2]))


def test_a_rank_that_cannot_read_its_peers_turns_it_off_for_all() -> None:
    """TORCHDIST_SHM_CMA=0 on one rank only (as if its peers could not be read): every
    rank sees no pids and takes the pipeline, so the ranks agree and the results hold."""
    outcomes = run_ranks(_one_rank_without_cma, 3, args=([70001],), timeout=120)
    for pids, reads, results in outcomes:
        assert pids is None and reads == 0
        assert all(torch.equal(a, b) for a, b in zip(results, outcomes[0][2]))


def _one_rank_without_cma(rank: int, world: int, sizes: list[int]):
    if rank == 1:
        os.environ["TORCHDIST_SHM_CMA"] = "0"
    return _reading_peers(rank, world, sizes)


def _unreadable_peer(rank: int, world: int) -> tuple[str, float]:
    """Rank 0 is told a wrong address for rank 1's tensor (as if its memory were gone)."""
    from torchdist._transport.shm_steps import Steps

    if rank == 0:
        published = Steps.address_of
        Steps.address_of = lambda self, j: 4096 if j == 1 else published(self, j)
    torchdist.init_process_group("shm", timeout=timedelta(seconds=20))
    start = time.monotonic()
    try:
        torchdist.all_reduce(torch.ones(1 << 20))  # 4 MiB: read from the peers
    except DistBackendError as exc:
        return str(exc), time.monotonic() - start
    raise AssertionError("the read of an unmapped address did not raise")


def test_a_failed_read_of_a_peer_raises_on_every_rank_naming_it() -> None:
    outcomes = run_ranks(_unreadable_peer, 3, timeout=60)
    message, elapsed = outcomes[0]
    assert "cannot read rank 1's tensor" in message and "ALLREDUCE" in message and "TORCHDIST_SHM_CMA=0" in message, \
        message
    for message, elapsed in outcomes:
        assert elapsed < 5, (elapsed, message)
    assert all("rank 0" in message for message, _ in outcomes[1:]), outcomes
