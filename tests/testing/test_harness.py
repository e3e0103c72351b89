"""Tests of torchdist.testing.run_ranks, the multi-process harness.

Every test here also checks that no rank outlives it (see
``_no_leftover_ranks``). The functions run on the ranks are defined at module
level, since ranks find them by reference.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from torchdist.testing import RanksFailed, RankStatus, free_port, run_ranks

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="checks processes through /proc"
)


# -- process table ---------------------------------------------------------


def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter), from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # exited while we looked
        # "pid (comm) state ppid ...": comm may contain spaces and parentheses.
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        table[int(entry)] = (int(ppid), state)
    return table


def _grandchildren() -> list[int]:
    """Live descendants of this process that are not its direct children.

    The ranks are children of the fork server, which (like multiprocessing's
    resource tracker) is a direct child of this process and stays for the
    session: any grandchild is a rank left behind.
    """
    table = _process_table()
    me = os.getpid()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], list(children.get(me, []))
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            if table[child][1] != "Z":
                found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    state = _process_table().get(pid)
    return state is not None and state[1] != "Z"


@pytest.fixture(autouse=True)
def _no_leftover_ranks() -> Iterator[None]:
    yield
    assert _grandchildren() == [], "run_ranks left processes behind"


# -- functions run on the ranks ---------------------------------------------


def _identity(rank: int, world_size: int, scale: torch.Tensor, *, offset: int = 0) -> tuple:
    return rank, world_size, scale * rank + offset


def _noop(rank: int, world_size: int) -> None:
    return None


def _environment(rank: int, world_size: int) -> dict[str, str | None]:
    names = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT", "TORCHDIST_TEST_EXTRA", "TORCHDIST_TEST_PARENT"]
    return {name: os.environ.get(name) for name in names}


def _thread_count(rank: int, world_size: int) -> int:
    return torch.get_num_threads()


def _in_default_group(rank: int, world_size: int) -> tuple[bool, int, int]:
    import torchdist

    return torchdist.is_initialized(), torchdist.get_rank(), torchdist.get_world_size()


def _destroy_the_default_group(rank: int, world_size: int) -> bool:
    import torchdist

    torchdist.destroy_process_group()
    return torchdist.is_initialized()


def _random_draw(rank: int, world_size: int) -> torch.Tensor:
    return torch.rand(4)


def _print(rank: int, world_size: int) -> None:
    print(f"hello on stdout from rank {rank}")
    print(f"hello on stderr from rank {rank}", file=sys.stderr)


def _raise_on(rank: int, world_size: int, failing: tuple[int, ...]) -> int:
    if rank in failing:
        raise ValueError(f"boom on rank {rank}")
    return rank


def _exit_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def _segfault_on_rank_0(rank: int, world_size: int) -> int:
    if rank == 0:
        os.kill(os.getpid(), signal.SIGSEGV)
    return rank


def _sleep_forever(rank: int, world_size: int, sleepers: tuple[int, ...]) -> int:
    if rank in sleepers:
        time.sleep(3600)  # the report must show this line
    return rank


def _fail_rank_0_and_hang_rank_1(rank: int, world_size: int) -> int:
    if rank == 0:
        raise RuntimeError("rank 0 gave up")
    if rank == 1:
        time.sleep(3600)
    return rank


def _leak_a_thread(rank: int, world_size: int) -> int:
    threading.Thread(target=time.sleep, args=(3600,), name="leaked-thread").start()
    return rank


def _unpicklable_result(rank: int, world_size: int) -> object:
    return threading.Lock()


def _start_a_child_and_return(rank: int, world_size: int) -> int:
    return subprocess.Popen(["sleep", "3600"]).pid  # neither waited for nor killed


def _record_pid_and_hang(rank: int, world_size: int, directory: str) -> None:
    Path(directory, f"rank{rank}.pid").write_text(str(os.getpid()))
    time.sleep(3600)


# -- results ------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_come_back_in_rank_order(world_size: int) -> None:
    results = run_ranks(
        _identity, world_size, args=(torch.arange(3.0),), kwargs={"offset": 10}
    )
    assert [r[:2] for r in results] == [(rank, world_size) for rank in range(world_size)]
    for rank, (_, _, tensor) in enumerate(results):
        assert torch.equal(tensor, torch.arange(3.0) * rank + 10)


def test_environment_is_set_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    # Set after the fork server started: ranks must see the current environment.
    monkeypatch.setenv("TORCHDIST_TEST_PARENT", "from-parent")
    envs = run_ranks(_environment, 3, env={"TORCHDIST_TEST_EXTRA": "x", "LOCAL_WORLD_SIZE": "7"})
    port = envs[0]["MASTER_PORT"]
    assert port is not None and 0 < int(port) < 65536
    for rank, env in enumerate(envs):
        assert env == {
            "RANK": str(rank),
            "WORLD_SIZE": "3",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "7",  # env overrides the harness's values
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "TORCHDIST_TEST_EXTRA": "x",
            "TORCHDIST_TEST_PARENT": "from-parent",
        }
    assert "TORCHDIST_TEST_EXTRA" not in os.environ


def test_omp_num_threads_in_env_sets_torch_threads() -> None:
    assert run_ranks(_thread_count, 2, env={"OMP_NUM_THREADS": "1"}) == [1, 1]


def test_a_backend_puts_fn_in_the_default_process_group() -> None:
    assert run_ranks(_in_default_group, 2, backend="gloo") == [(True, 0, 2), (True, 1, 2)]
    # fn may destroy the group itself; the harness then does not destroy it again.
    assert run_ranks(_destroy_the_default_group, 2, backend="gloo") == [False, False]


def test_random_generators_differ_between_ranks_and_calls() -> None:
    first = run_ranks(_random_draw, 2)
    second = run_ranks(_random_draw, 2)
    draws = [tuple(t.tolist()) for t in first + second]
    assert len(set(draws)) == 4


def test_rank_output_reaches_the_test_process(capfd: pytest.CaptureFixture[str]) -> None:
    run_ranks(_print, 2)
    out, err = capfd.readouterr()
    for rank in range(2):
        assert f"hello on stdout from rank {rank}" in out
        assert f"hello on stderr from rank {rank}" in err


def test_starting_ranks_is_cheap() -> None:
    """torch is imported once in the fork server, not once per rank (about 1.3 s)."""
    run_ranks(_noop, 4)
    best = float("inf")
    for _ in range(3):
        began = time.perf_counter()
        run_ranks(_noop, 4)
        best = min(best, time.perf_counter() - began)
    assert best < 1.0, f"run_ranks(noop, 4) took {best:.2f} s"


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


# -- failures -----------------------------------------------------------------


def test_exceptions_are_reported_with_rank_and_traceback() -> None:
    with pytest.raises(RanksFailed) as info:
        run_ranks(_raise_on, 4, args=((1, 3),))
    message = str(info.value)
    for rank in (1, 3):
        assert f"rank {rank} raised ValueError: boom on rank {rank}" in message
    assert "Traceback (most recent call last)" in message
    assert 'raise ValueError(f"boom on rank {rank}")' in message
    assert "ranks that succeeded: [0, 2]" in message
    assert info.value.failed_ranks == [1, 3]
    assert [o.status for o in info.value.outcomes] == [
        RankStatus.RETURNED, RankStatus.RAISED, RankStatus.RETURNED, RankStatus.RAISED
    ]
    assert info.value.outcomes[2].result == 2


def test_a_rank_that_exits_is_reported_with_its_exit_code() -> None:
    with pytest.raises(RanksFailed) as info:
        run_ranks(_exit_on_rank_1, 3)
    assert "rank 1 died without reporting: exited with code 3" in str(info.value)
    assert "ranks that succeeded: [0, 2]" in str(info.value)


def test_a_rank_that_crashes_is_reported_with_its_signal_and_stack() -> None:
    with pytest.raises(RanksFailed) as info:
        run_ranks(_segfault_on_rank_0, 2)
    message = str(info.value)
    assert "rank 0 died without reporting: killed by signal SIGSEGV" in message
    assert "in _segfault_on_rank_0" in message  # faulthandler's dump
    assert "os.kill(os.getpid(), signal.SIGSEGV)" in message


def test_a_hanging_rank_is_killed_at_the_timeout_with_its_stack() -> None:
    began = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_ranks(_sleep_forever, 2, args=((1,),), timeout=1.0)
    elapsed = time.monotonic() - began
    message = str(info.value)
    assert "rank 1 still running at the 1.0 s timeout" in message
    assert "in _sleep_forever" in message
    assert "time.sleep(3600)  # the report must show this line" in message
    assert "ranks that succeeded: [0]" in message
    assert elapsed < 5, f"took {elapsed:.1f} s"


def test_after_a_failure_the_other_ranks_get_only_a_grace_period() -> None:
    began = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_ranks(_fail_rank_0_and_hang_rank_1, 3, timeout=60, grace=0.5)
    elapsed = time.monotonic() - began
    message = str(info.value)
    assert "rank 0 raised RuntimeError: rank 0 gave up" in message
    assert "rank 1 still running 0.5 s after rank 0 failed" in message
    assert "time.sleep(3600)" in message
    assert "ranks that succeeded: [2]" in message
    assert elapsed < 5, f"took {elapsed:.1f} s"


def test_a_rank_that_returns_but_does_not_exit_is_reported() -> None:
    with pytest.raises(RanksFailed) as info:
        run_ranks(_leak_a_thread, 2, grace=0.5)
    message = str(info.value)
    assert "rank 0 returned but had not exited 0.5 s later" in message
    assert "time.sleep" in message or "threading" in message
    assert info.value.failed_ranks == [0, 1]
    assert {o.status for o in info.value.outcomes} == {RankStatus.DID_NOT_EXIT}


def test_an_unpicklable_result_is_reported() -> None:
    with pytest.raises(RanksFailed) as info:
        run_ranks(_unpicklable_result, 1)
    assert "cannot be pickled back to the test process" in str(info.value)


def test_bad_arguments_are_rejected_before_starting() -> None:
    with pytest.raises(TypeError, match="picklable by reference|pickled by reference"):
        run_ranks(lambda rank, world_size: None, 2)
    with pytest.raises(ValueError, match="world_size must be at least 1, got 0"):
        run_ranks(_noop, 0)
    with pytest.raises(TypeError, match="env must map str to str"):
        run_ranks(_noop, 1, env={"X": 1})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="timeout must be positive"):
        run_ranks(_noop, 1, timeout=0)


# -- cleanup ------------------------------------------------------------------


def test_an_interrupted_call_kills_its_ranks() -> None:
    """KeyboardInterrupt (or pytest-timeout's signal method) in the test process."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(KeyboardInterrupt):
            run_ranks(_sleep_forever, 3, args=((0, 1, 2),), timeout=30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    # The autouse fixture checks that the ranks are gone.


def test_ranks_die_with_the_test_process(tmp_path: Path) -> None:
    """The test process is SIGKILLed (pytest-timeout's thread method os._exit()s)."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_harness import _record_pid_and_hang
        from torchdist.testing import run_ranks
        run_ranks(_record_pid_and_hang, 2, args=({str(tmp_path)!r},), timeout=60)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        pid_files = [tmp_path / f"rank{rank}.pid" for rank in range(2)]
        deadline = time.monotonic() + 30
        while not all(f.exists() and f.read_text() for f in pid_files):
            assert parent.poll() is None, "the test process ended early"
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.05)
        pids = [int(f.read_text()) for f in pid_files]
        assert all(_alive(pid) for pid in pids)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"ranks {pids} outlived their test process"
        time.sleep(0.05)


def test_processes_a_rank_leaves_running_are_killed() -> None:
    pids = run_ranks(_start_a_child_and_return, 2)
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"children {pids} of the ranks outlived them"
        time.sleep(0.02)
