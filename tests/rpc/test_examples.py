"""Every example in examples/rpc runs to completion and reports success."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "rpc"


@pytest.mark.parametrize("script, marker", [
    ("parameter_server.py", "parameter server: OK"),
    ("rl_observers.py", "rl observers: OK"),
    ("model_parallel.py", "model parallel: OK"),
    ("pipeline.py", "pipeline: OK"),
])
def test_example_runs(script, marker):
    proc = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=100,
                          cwd=EXAMPLES)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert marker in proc.stdout
