"""Threads, futures and a group's end, as PyTorch's gloo behaves (checked with torch 2.13):

- a Work's future is complete, its callbacks run, before ``wait()`` returns, so an
  op a callback issues comes before the waiter's next op on every rank;
- a thread blocked in ``recv`` does not keep the other threads' collectives from
  running (the message may come only after one of them);
- ``wait(timeout)`` gives up at the timeout, and the op goes on;
- ``destroy_process_group`` lets ops in flight finish, whether queued (async) or
  running on another thread; it never pulls memory from under them;
- a process that exits with an async op it never waited on, or while a future
  callback still runs, exits cleanly; so does a forked child;
- Ctrl-C inside a collective is a ``KeyboardInterrupt`` (gloo delivers it once its
  C++ op returns; here the op stops, the group breaks and the peers are told).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch

import torchdist as dist
from torchdist.testing import free_port, run_ranks

BACKENDS = ["tcp", "shm", "auto"]


def _callback_issues_an_op(rank: int, world: int, numel: int):
    """A's future callback issues B; the main thread issues C (same shape) after A.wait().

    Rank 0 issues A before its peers arrive, so A completes on the engine's worker."""
    wrong, done_at_wait = 0, 0
    for it in range(10):
        dist.barrier()
        if rank != 0:
            time.sleep(0.02)
        issued = {}
        a = torch.ones(numel)
        work = dist.all_reduce(a, async_op=True)

        def callback(future, it=it):
            b = torch.full((4,), 1000.0 + it)
            issued["b"], issued["work"] = b, dist.all_reduce(b, async_op=True)
            return True
        chained = work.get_future().then(callback)
        work.wait()
        done_at_wait += work.get_future().done() and "work" in issued
        c = torch.full((4,), float(it))
        dist.all_reduce(c)
        chained.wait()
        issued["work"].wait()
        wrong += issued["b"][0].item() != world * (1000.0 + it) or c[0].item() != world * it
    return wrong, done_at_wait


@pytest.mark.parametrize("backend", BACKENDS)
def test_future_callbacks_run_before_wait_returns(backend: str) -> None:
    for wrong, done_at_wait in run_ranks(_callback_issues_an_op, 3, args=(1 << 16,), backend=backend,
                                         timeout=90):
        assert (wrong, done_at_wait) == (0, 10)


def _recv_thread_and_collective(rank: int, world: int, any_source: bool):
    """Rank 0: a thread blocks in recv; the main thread's all-reduce must still run,
    because rank 1 sends only after it."""
    received = []
    if rank == 0:
        def receive():
            y = torch.zeros(2)
            source = dist.recv(y, src=None if any_source else 1)
            received.append((source, y[0].item()))
        thread = threading.Thread(target=receive)
        thread.start()
        time.sleep(0.2)  # the thread is inside recv
    z = torch.ones(2)
    dist.all_reduce(z)
    if rank == 1:
        dist.send(torch.full((2,), 42.0), dst=0)
    else:
        thread.join(30)
    return z[0].item(), received


@pytest.mark.parametrize("any_source", [False, True], ids=["src", "any-source"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_thread_blocked_in_recv_lets_other_threads_run_collectives(backend: str, any_source: bool) -> None:
    results = run_ranks(_recv_thread_and_collective, 2, args=(any_source,), backend=backend, timeout=60)
    assert results == [(2.0, [(1, 42.0)]), (2.0, [])]


def _wait_with_timeout(rank: int, world: int):
    t = torch.full((4,), float(rank + 1))
    if rank == 1:
        time.sleep(1.5)
    work = dist.all_reduce(t, async_op=True)
    outcome = "completed"
    start = time.monotonic()
    if rank == 0:
        try:
            work.wait(timeout=timedelta(seconds=0.2))
        except RuntimeError as exc:  # PyTorch: RuntimeError; torchdist: DistBackendError, a subclass
            outcome = f"{type(exc).__name__} after {time.monotonic() - start:.1f}s"
    work.wait()
    dist.all_reduce(t)  # the group is still usable
    return outcome, t[0].item()


@pytest.mark.parametrize("backend", BACKENDS)
def test_wait_with_a_timeout_gives_up_and_the_op_goes_on(backend: str) -> None:
    (outcome, value), rest = run_ranks(_wait_with_timeout, 2, backend=backend, timeout=60)
    assert outcome in ("DistBackendError after 0.2s", "DistBackendError after 0.3s"), outcome
    assert value == 6.0 and rest == ("completed", 6.0)


def _destroy_while_in_use(rank: int, world: int, which: str):
    group = dist.new_group(list(range(world))) if which == "subgroup" else None
    results = []

    def reduce():
        t = torch.ones(4)
        dist.all_reduce(t, group=group)
        results.append(t[0].item())
    if rank == 0:
        thread = threading.Thread(target=reduce)
        thread.start()
        time.sleep(0.5)  # the thread waits for rank 1 inside the all-reduce
        dist.destroy_process_group(group)
        thread.join(20)
        return results
    time.sleep(1.5)
    reduce()
    if which == "subgroup":
        dist.destroy_process_group(group)
    return results


@pytest.mark.parametrize("which", ["subgroup", "world"])
@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_destroy_lets_another_threads_op_finish(backend: str, which: str) -> None:
    # (no ``backend=``: rank 0 destroys the world group itself)
    assert run_ranks(_init_then, 2, args=(backend, _destroy_while_in_use, which), timeout=60) == [[2.0], [2.0]]


def _destroy_with_async_work(rank: int, world: int):
    works = [(t, dist.all_reduce(t, async_op=True)) for t in (torch.full((n,), float(rank + 1))
                                                            for n in (4, 1 << 18, 8))]
    dist.destroy_process_group()
    values = []
    for t, work in works:
        work.wait()
        values.append(t[0].item())
    return values


@pytest.mark.parametrize("backend", BACKENDS)
def test_destroy_finishes_async_work_first(backend: str) -> None:
    assert run_ranks(_init_then, 2, args=(backend, _destroy_with_async_work), timeout=60) == [[3.0] * 3] * 2


def _init_then(rank: int, world: int, backend: str, body, *args):
    dist.init_process_group(backend, rank=rank, world_size=world)
    return body(rank, world, *args)


_EXIT_WITH_ASYNC_WORK = """
import torch, torchdist as dist
dist.init_process_group({backend!r})
t = torch.ones(1 << 18)
work = dist.all_reduce(t, async_op=True)
print("leaving", flush=True)
"""


_EXIT_WITH_A_CALLBACK_RUNNING = """
import time, torch, torchdist as dist
dist.init_process_group({backend!r})
if dist.get_rank() == 1:
    time.sleep(0.3)  # rank 0's op completes on its worker: the callback runs on a callback thread
big = torch.randn(600, 600)

def callback(future):
    for _ in range(40):  # torch code, still running when the main thread exits
        torch.mm(big, big)
    print("callback done", flush=True)
dist.all_reduce(torch.ones(4), async_op=True).get_future().then(callback)
dist.destroy_process_group()
print("leaving", flush=True)
"""


def _run_ranks_as_programs(script: str, world: int = 2) -> list[tuple[int, str]]:
    """Run ``script`` as ``world`` programs (env://), as a launcher would: each exits as
    a program does, through the interpreter's exit (harness workers do not)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1")
    # Each rank leads a session of its own, so that processes it forked die with it.
    procs = [subprocess.Popen([sys.executable, "-c", script], env=dict(env, RANK=str(rank)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for rank in range(world)]
    try:
        outputs = [proc.communicate(timeout=60)[0] for proc in procs]
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return [(proc.returncode, output) for proc, output in zip(procs, outputs)]


_STORE_HOST_EXITS_BEFORE_A_GROUP_IT_IS_NOT_IN = """
import torch, torchdist as dist
dist.init_process_group({backend!r})
group = dist.new_group([1, 2, 3])
if dist.get_rank() != 0:  # rank 0, which hosts the store, leaves at once without destroying anything
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    print("sum", t.item(), flush=True)
    dist.destroy_process_group()
"""


def _store_host_returns_at_once(rank: int, world: int, backend: str) -> float | None:
    dist.init_process_group(backend, rank=rank, world_size=world)
    group = dist.new_group([1, 2, 3])
    if rank == 0:  # leaves without destroying anything: its process exits as multiprocessing's children do
        return None
    time.sleep(0.5)  # rank 0 is gone from run() by now
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    dist.destroy_process_group()
    return t.item()


@pytest.mark.parametrize("backend", ["tcp", "auto"])
def test_the_store_host_waits_for_the_ranks_in_a_multiprocessing_child_too(backend: str) -> None:
    """A multiprocessing child (mp.spawn's worker, this harness's rank) exits through os._exit,
    without atexit handlers: the store host stopped its server under the others (CI saw it)."""
    assert run_ranks(_store_host_returns_at_once, 4, args=(backend,), timeout=60) == [None, 3.0, 3.0, 3.0]


@pytest.mark.parametrize("backend", ["tcp", "auto"])
def test_the_store_host_lets_the_ranks_still_running_finish_with_its_store(backend: str) -> None:
    """The members bootstrap their group through the store: a host that stopped it at
    exit made them fail (ConnectionResetError), 5 runs in 5."""
    results = _run_ranks_as_programs(_STORE_HOST_EXITS_BEFORE_A_GROUP_IT_IS_NOT_IN.format(backend=backend), 4)
    for rank, (returncode, output) in enumerate(results):
        assert returncode == 0, (rank, output)
        assert rank == 0 or "sum 3.0" in output, (rank, output)


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_exit_with_an_async_op_never_waited_on_is_clean(backend: str) -> None:
    for _ in range(2):
        for returncode, output in _run_ranks_as_programs(_EXIT_WITH_ASYNC_WORK.format(backend=backend)):
            assert returncode == 0 and "leaving" in output, output


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_exit_waits_for_a_future_callback_still_running(backend: str) -> None:
    # A daemon thread inside torch code when the interpreter finalizes aborts the
    # process ("terminate called without an active exception").
    for returncode, output in _run_ranks_as_programs(_EXIT_WITH_A_CALLBACK_RUNNING.format(backend=backend)):
        assert returncode == 0 and "callback done" in output and "leaving" in output, output


def _interrupted(rank: int, world: int):
    """Rank 1 gets Ctrl-C (SIGINT) while it waits in an all-reduce that rank 0 joins only once rank 1
    was interrupted (a store key; a fixed delay let a loaded machine finish the op before the signal)."""
    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    if rank == 1:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    else:
        store.wait(["interrupted"], timedelta(seconds=30))
    try:
        for _ in range(2):
            dist.all_reduce(torch.ones(4))
    except KeyboardInterrupt:
        store.set("interrupted", "1")
        return "KeyboardInterrupt"
    except RuntimeError as exc:
        return str(exc)
    return "completed"


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_ctrl_c_in_a_collective_is_a_keyboard_interrupt_and_the_peers_hear_of_it(backend: str) -> None:
    peer, interrupted = run_ranks(_init_then, 2, args=(backend, _interrupted), timeout=60)
    assert interrupted == "KeyboardInterrupt"
    assert "interrupted on rank 1 (KeyboardInterrupt)" in peer, peer


_FORKED_CHILD_EXITS = """
import os, sys, time, torch, torchdist as dist
dist.init_process_group({backend!r})
work = dist.all_reduce(torch.ones(1 << 18), async_op=True)
work.get_future().then(lambda _: time.sleep(0.5))  # a callback may be running at the fork
pid = os.fork()
if pid == 0:
    sys.exit(0)  # runs the exit handlers, as a child's normal exit does
start = time.monotonic()
_, status = os.waitpid(pid, 0)
work.wait()
print("child", os.waitstatus_to_exitcode(status), "quick" if time.monotonic() - start < 5 else "slow", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_forked_child_exits_at_once(backend: str) -> None:
    # A forked child (a DataLoader worker, a helper process) that exits normally runs the
    # exit handlers on its copies of the groups and callback threads, whose ops and
    # callbacks are the parent's: waiting for them, it would wait for ever.
    for returncode, output in _run_ranks_as_programs(_FORKED_CHILD_EXITS.format(backend=backend)):
        assert returncode == 0 and "child 0 quick" in output, output


def _collective_in_a_forked_child(rank: int, world: int) -> tuple[str, list[float]]:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its copy of the group shares the parent's connections and memory
        try:
            dist.all_reduce(torch.ones(2))
            message = "nothing raised"
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            message = f"{type(exc).__name__}: {exc}"
        os.write(write_end, message.encode()[:2000])
        os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    message = os.read(read_end, 4096).decode()
    os.close(read_end)
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)  # the parents' group is intact
    return message, t.tolist()


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_forked_child_cannot_use_its_parents_group(backend: str) -> None:
    for rank, (message, after) in enumerate(run_ranks(_collective_in_a_forked_child, 2, backend=backend,
                                                      timeout=60)):
        assert message.startswith("DistBackendError") and "is a fork of it" in message, message
        assert f"rank {rank}" in message and after == [3.0, 3.0]
