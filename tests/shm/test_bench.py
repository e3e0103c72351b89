"""torchdist-bench runs end to end on small sizes and verifies every result (#wrong = 0).

Timings are not asserted: CI machines are noisy. The gloo comparison and the plot
run once, on two tiny sizes."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from torchdist.bench.cli import parse_size


def _bench(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchdist.bench", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_sizes_parse_like_nccl_tests() -> None:
    assert [parse_size(s) for s in ("8", "64K", "1M", "64M", "2G", "512KiB")] == [
        8, 65536, 1 << 20, 64 << 20, 2 << 30, 512 << 10]


@pytest.mark.parametrize("nproc, backend, extra", [(2, "shm", ()), (3, "auto", ()), (2, "tcp", ()),
                                                   (3, "shm", ("--symmetric",))])
def test_every_collective_is_verified(tmp_path, nproc: int, backend: str, extra: tuple) -> None:
    out = tmp_path / "rows.json"
    proc = _bench("all", "-b", "8", "-e", "256K", "-f", "32", "--nproc", str(nproc), "--backend", backend,
                  "-n", "3", "-w", "1", "-r", "1", "--json", str(out), *extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for column in ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"):
        assert column in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert {r["op"] for r in rows} == {"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter",
                                      "alltoall"}
    assert all(r["wrong"] == 0 for r in rows), [r for r in rows if r["wrong"]]
    assert {r["size"] for r in rows if r["op"] == "all_reduce"} == {8, 256, 8192, 262144}


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed")
def test_compare_with_gloo_interleaved_and_plot(tmp_path) -> None:
    plot = tmp_path / "bench.png"
    proc = _bench("all_reduce,broadcast", "-b", "8", "-e", "64K", "-f", "8192", "--nproc", "2",
                  "--backend", "shm", "--compare", "gloo", "-n", "3", "-w", "1", "-r", "2",
                  "--plot", str(plot))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line and not line.startswith("#")]
    assert len(lines) == 4 and all(line.rstrip().endswith("x") for line in lines), proc.stdout
    assert plot.stat().st_size > 1000


class _Misplacing:
    """A stand-in for a dist module of one rank whose collectives return the right values
    in the wrong places (rolled by one element)."""

    class ReduceOp:
        SUM, PRODUCT, MIN, MAX = "sum", "prod", "min", "max"

    all_gather_into_tensor = reduce_scatter_tensor = None

    @staticmethod
    def all_reduce(tensor, op=None):
        tensor.copy_(tensor.roll(1))

    @staticmethod
    def broadcast(tensor, src):
        tensor.copy_(tensor.roll(1))

    @staticmethod
    def all_to_all_single(output, input):
        output.copy_(input.roll(1))


@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "alltoall"])
def test_the_check_counts_misplaced_elements(op: str) -> None:
    """The check data differ by position, so right values in the wrong places are wrong
    (with a uniform fill per rank the check passed them)."""
    import torch

    from torchdist.bench.worker import Job, _Case

    job = Job(ops=(op,), sizes=(4096,), backend="shm", compare=None)
    case = _Case(_Misplacing(), op, 4096, world=1, rank=0, job=job)
    assert case.check() > 0
    torch.testing.assert_close(case.inp, torch.zeros_like(case.inp))  # the buffers are zeroed afterwards


def test_prod_an_unsupported_baseline_dtype_and_no_check(tmp_path) -> None:
    """-o prod runs (ReduceOp.PRODUCT); gloo has no int16: its columns say n/a and the
    torchdist rows stay; -c 0 prints N/A, not a pass."""
    out = tmp_path / "rows.json"
    proc = _bench("all_reduce,all_gather", "-b", "16", "-e", "1K", "-f", "64", "--nproc", "2", "--backend", "shm",
                  "-o", "prod", "-d", "int16", "--compare", "gloo", "-n", "2", "-w", "1", "-r", "1",
                  "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "n/a: gloo refused all_reduce with int16" in proc.stdout, proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert all(r["wrong"] == 0 for r in rows if r["impl"] == "torchdist")
    assert all(r["time_us"] is None for r in rows if r["impl"] == "gloo")
    unchecked = _bench("all_reduce", "-b", "8", "-e", "8", "--nproc", "1", "-c", "0", "-n", "2", "-w", "0")
    assert unchecked.returncode == 0 and "Out of bounds values : N/A" in unchecked.stdout, unchecked.stdout


@pytest.mark.parametrize("args", [["--root", "2", "--nproc", "2"], ["--nproc", "0"], ["-d", "floaty"],
                                  ["-b", "64", "-e", "8"], [","], ["-f", "1"]])
def test_a_bad_command_line_exits_2_before_any_rank_starts(args: list[str]) -> None:
    proc = _bench(*args, timeout=60)
    assert proc.returncode == 2 and "torchdist-bench: error:" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_sigterm_reaps_the_ranks_and_their_scratch_folder(tmp_path) -> None:
    """As Ctrl-C does; by default SIGTERM skipped the cleanup and left a folder in $TMPDIR."""
    import os
    import signal
    import time

    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "torchdist.bench", "all_reduce", "-b", "8", "-e", "8",
                             "--nproc", "2", "--backend", "shm", "-n", "100000", "-w", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("torchdist-ranks-*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(2)  # the ranks are running
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143, proc.stderr.read()
    assert not list(tmp_path.glob("torchdist-ranks-*"))
