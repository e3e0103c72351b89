"""The "mpi" backend: jobs started by mpiexec, each rank running tests/backends/mpi_worker.py.

Skipped where mpi4py or mpiexec is missing (the CI installs both: mpi4py and the
mpich wheel). Each job is bounded by a timeout, after which its whole process
group is killed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import torchdist as dist
from torchdist.testing import run_ranks

ROOT = Path(__file__).resolve().parents[2]


def _mpiexec() -> str | None:
    """The mpiexec installed beside this Python (the mpich wheel's, matching mpi4py), else on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


pytestmark = pytest.mark.skipif(not dist.is_mpi_available() or _mpiexec() is None,
                                reason="needs mpi4py and mpiexec (pip install mpi4py mpich)")


def _launch(ranks: int, argv: list[str], timeout: float = 90) -> tuple[int, str]:
    """Run ``python ARGV`` as an MPI job of ``ranks`` processes: (exit status, output)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    proc = subprocess.Popen([_mpiexec(), "-n", str(ranks), sys.executable, *argv], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"mpiexec -n {ranks} {' '.join(argv)} did not finish in {timeout} s; output:\n{output}")
    return proc.returncode, output


def _run(mode: str, ranks: int, out: Path) -> list:
    """Each rank's result of ``mpi_worker.MODE`` in a job of ``ranks`` processes (written under ``out``)."""
    status, output = _launch(ranks, ["-m", "tests.backends.mpi_worker", mode, str(out)])
    results = {int(path.stem): json.loads(path.read_text()) for path in out.glob("*.json")}
    assert sorted(results) == list(range(ranks)), f"exit {status}; output:\n{output}"
    for rank, result in results.items():
        assert not (isinstance(result, dict) and "error" in result), f"rank {rank}:\n{result['error']}"
    return [results[rank] for rank in range(ranks)]


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_every_collective_matches_torch(ranks, tmp_path):
    assert _run("battery", ranks, tmp_path) == [[]] * ranks


@pytest.mark.parametrize("ranks", [2, 3])
def test_point_to_point_and_async(ranks, tmp_path):
    results = _run("point_to_point", ranks, tmp_path)
    big_sum, small = results[0]["early"]
    assert big_sum == 50_000 and small == [1.0, 2.0, 3.0]
    assert results[0]["sources"] == list(range(1, ranks)) and sorted(results[0]["any"]) == list(range(1, ranks))
    for n in (3, 4097):
        assert results[1][f"larger recv {n}"] == [n * (n - 1) / 2, [-1.0] * 10]
    assert results[1]["in order"]
    for rank, result in enumerate(results):
        assert result["ring"] == (rank - 1) % ranks
        assert result["async"] == ranks


def test_groups_objects_and_a_tcp_group_beside(tmp_path):
    results = _run("groups", 4, tmp_path)
    for rank, result in enumerate(results):
        assert result["sub"] == (0 + 2 if rank % 2 == 0 else 1 + 3)
        assert result["tcp"] == 4
        assert result["objects"] == [{"rank": r} for r in range(4)]
        assert result["backend"] == "mpi"


@pytest.mark.parametrize("ranks", [2, 3])
def test_ddp_matches_one_process(ranks, tmp_path):
    assert _run("ddp", ranks, tmp_path) == [True] * ranks


def test_a_mismatch_raises_on_every_rank_naming_both_ops(tmp_path):
    for errors in _run("mismatch", 3, tmp_path):
        first, second = errors
        assert "mismatch at sequence number" in first, errors
        assert "dtype=torch.float32" in first and "dtype=torch.float64" in first, errors
        assert "no error" not in second, errors


@pytest.mark.parametrize("ranks", [2, 3])
def test_two_roots_of_one_broadcast_is_a_mismatch(ranks, tmp_path):
    """Before, ranks that only send parked each other's message: every rank waited for the
    timeout, and one of them blamed a rank that had arrived."""
    for message in _run("two_roots", ranks, tmp_path):
        seconds, rest = message.split("s ", 1)
        assert float(seconds) < 10 and "collective mismatch at sequence number 0" in rest, message
        assert "root=0" in rest and "root=1" in rest, message


def test_a_stalled_rank_is_named_at_the_timeout(tmp_path):
    results = _run("stall", 3, tmp_path)
    for message in results[:2]:
        seconds, rest = message.split("s ", 1)
        assert 1.5 < float(seconds) < 15, message
        assert "allreduce" in rest and "ranks [2] did not arrive" in rest, message
    assert "aborted by rank" in results[2], results[2]


def test_waiters_follow_the_chain_of_waits_to_the_stalled_rank(tmp_path):
    """WAITING notices, as on tcp (_transport/waits.py): without them rank 2 named rank 0,
    which was waiting on rank 3 itself."""
    for message in _run("chain", 4, tmp_path)[:3]:
        assert "ranks [3] did not arrive" in message, message


def test_a_rank_that_leaves_is_named_at_once(tmp_path):
    waiter, leaver = _run("left", 2, tmp_path)
    assert leaver == "left"
    seconds, rest = waiter.split("s ", 1)
    assert float(seconds) < 10 and "rank 0 lost rank 1: it left the group" in rest, waiter


def test_a_send_to_a_rank_that_left_without_receiving_it_fails_naming_it(tmp_path):
    """Before, the send waited for the group's timeout and blamed a rank that "did not arrive"."""
    sender, leaver = _run("left_unreceived", 2, tmp_path)
    assert leaver == "left"
    seconds, rest = sender.split("s ", 1)
    assert float(seconds) < 10 and "rank 0 lost rank 1: it left the group" in rest, sender
    assert "without receiving" in rest, sender


def test_a_rank_that_dies_of_an_exception_is_named_at_once(tmp_path):
    """It closes its groups on the way out (LEFT notices): without that, rank 0 waited
    for its timeout, and rank 1 for rank 0 inside MPI_Finalize."""
    status, output = _launch(2, ["-m", "tests.backends.mpi_worker", "crash", str(tmp_path)])
    assert "a bug in the training script" in output
    waiter = json.loads((tmp_path / "0.json").read_text())
    seconds, rest = waiter.split("s ", 1)
    assert float(seconds) < 10 and "rank 0 lost rank 1: it left the group" in rest, waiter


def test_torchdist_bench_runs_as_an_mpi_job_like_nccl_tests(tmp_path):
    out = tmp_path / "rows.json"
    status, output = _launch(2, ["-m", "torchdist.bench", "all_reduce,all_gather", "-b", "8", "-e", "64K", "-f",
                                 "64", "--backend", "mpi", "--compare", "gloo", "-n", "3", "-w", "1", "-r", "1",
                                 "--json", str(out)])
    assert status == 0, output
    assert output.count("# torchdist-bench: world size 2, backend 'mpi'") == 1, output  # rank 0 reports
    rows = json.loads(out.read_text())["rows"]
    assert {(r["op"], r["impl"]) for r in rows} == {(op, impl) for op in ("all_reduce", "all_gather")
                                                    for impl in ("torchdist", "gloo")}
    assert all(r["wrong"] == 0 for r in rows), rows


def test_the_main_job_trains_over_mpi(tmp_path):
    status, output = _launch(2, [str(ROOT / "examples" / "ddp_digits.py"), "--backend", "mpi", "--epochs", "3",
                                 "--no-progress", "--checkpoint", str(tmp_path / "ckpt.pt")], timeout=180)
    assert status == 0, output
    accuracy = float(output.split("final test accuracy: ")[1].split()[0])
    assert accuracy > 0.7 and "identical on all 2 ranks: True" in output, output


def _mpi_group_outside_mpiexec(rank, world_size):
    try:
        dist.new_group(backend="mpi")
    except dist.DistBackendError as exc:
        return str(exc)
    finally:
        # Each rank started MPI as a job of one. A run_ranks rank is a fork that ends with
        # os._exit, which skips mpi4py's exit handler: without this, MPICH's shared memory
        # file of each one-process job stays in /dev/shm.
        from mpi4py import MPI

        MPI.Finalize()
    return "no error"


def test_ranks_not_started_by_one_mpiexec_get_a_clear_error():
    for message in run_ranks(_mpi_group_outside_mpiexec, 2, backend="tcp"):
        assert "needs every rank of the group in one MPI job" in message and "mpiexec" in message, message


def test_a_process_started_by_a_launcher_rather_than_mpiexec_is_refused():
    """Each such rank would be an MPI job of one and train alone, silently."""
    env = dict(os.environ, WORLD_SIZE="2", RANK="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", "import torchdist; torchdist.init_process_group('mpi')"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "WORLD_SIZE=2" in proc.stderr and "mpiexec" in proc.stderr, proc.stderr


def test_without_mpi4py_the_backend_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    assert not dist.is_mpi_available()
    with pytest.raises(RuntimeError, match="doesn't have MPI built in.*mpi4py"):
        dist.init_process_group("mpi", store=dist.HashStore(), rank=0, world_size=1)
    assert not dist.is_initialized()
