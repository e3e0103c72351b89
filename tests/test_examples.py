"""The top-level examples run as a user would run them."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_data_parallel_sgd_trains_and_keeps_replicas_identical():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "data_parallel_sgd.py"), "--nproc", "2", "--epochs", "5"],
        capture_output=True, text=True, timeout=100,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "parameters identical on all 2 ranks: True" in result.stdout, result.stdout
