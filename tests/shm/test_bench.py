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
