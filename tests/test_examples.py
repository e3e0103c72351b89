"""The top-level examples run as a user would run them."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_data_parallel_sgd_trains_and_keeps_replicas_identical():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "data_parallel_sgd.py"), "--nproc", "2", "--epochs", "5"],
        capture_output=True, text=True, timeout=100,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "parameters identical on all 2 ranks: True" in result.stdout, result.stdout


def _torchdist_run(script: str, *args: str, timeout: float = 120) -> str:
    """Run ``examples/<script>`` under ``torchdist-run --standalone --nproc-per-node 2``; return its output."""
    result = subprocess.run(
        [sys.executable, "-m", "torchdist.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "examples" / script), *args],
        capture_output=True, text=True, timeout=timeout,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return result.stdout


def test_pipeline_parallel_example_trains():
    out = _torchdist_run("pipeline_parallel.py", "--steps", "20")
    losses = [float(line.split("loss")[1]) for line in out.splitlines() if line.startswith("step")]
    assert len(losses) == 20 and losses[-1] < losses[0], out


def test_tensor_parallel_example_trains_and_matches_the_unparallelized_model():
    out = _torchdist_run("tensor_parallel.py")
    losses = [float(line.split("loss")[1]) for line in out.splitlines() if line.startswith("step")]
    assert losses and losses[-1] < losses[0], out
    assert out.count("matches the unparallelized model: True") == 2, out


def test_fsdp_digits_example_trains_on_two_ranks():
    pytest.importorskip("sklearn")  # the example's data set (the ``examples`` extra)
    out = _torchdist_run("fsdp_digits.py", "--epochs", "3", "--bf16")
    assert "rank 0 stores 8613 of 17226 parameter elements" in out, out
    accuracies = [float(a) for a in re.findall(r"test accuracy ([0-9.]+)", out)]
    assert len(accuracies) == 3 and accuracies[-1] > 0.8, out
    assert "full state dict: 17226 elements" in out, out
