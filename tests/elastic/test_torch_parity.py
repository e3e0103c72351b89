"""The same torch.distributed.elastic programs, run on torch and on torchdist, observe the same things.

Each program (``custom_agent_program.py``, ``start_processes_program.py``) takes the
library's name and writes what it saw as JSON; only values that cannot be equal
(timestamps, file paths inside tracebacks) are normalized before comparing.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(180)

HERE = pathlib.Path(__file__).parent


def _run(program: str, *args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(HERE / program), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_a_custom_simple_elastic_agent_behaves_as_on_torch(tmp_path):
    """Steps taken, restarts, result, metrics (names, groups, values) and events are torch's."""
    torch_run = json.loads(_run("custom_agent_program.py", "torch", cwd=tmp_path).stdout)
    ours = json.loads(_run("custom_agent_program.py", "torchdist", cwd=tmp_path).stdout)
    assert ours["state"] == "SUCCEEDED" and ours["return_values"] == {"0": "ok0", "1": "ok1"}
    assert ours["rounds"] == 2  # one failure, one restart
    assert ours == torch_run


def _normalized(observed: dict) -> dict:
    """The failures' error records keep their message; tracebacks and timestamps differ by nature."""
    for run in observed.values():
        for rank, (exitcode, local_rank, message) in run["failures"].items():
            if isinstance(message, dict):
                message = message["message"]
            elif message.startswith("To enable traceback"):
                message = "<no error file>"  # each library's message points to its own docs
            run["failures"][rank] = [exitcode, local_rank, message]
    # torch's function workers send their traceback to the parent; torchdist's print it too (stderr.log)
    observed["function_fails"]["stderrs"]["0"][1] = None
    return observed


def test_start_processes_behaves_as_on_torch(tmp_path):
    """Context kinds, return values, failures, log-file layout and contents, teed console lines."""
    results = {}
    for lib in ("torch", "torchdist"):
        proc = _run("start_processes_program.py", lib, str(tmp_path / lib), str(tmp_path / f"{lib}.json"), cwd=tmp_path)
        observed = json.loads((tmp_path / f"{lib}.json").read_text())
        results[lib] = (_normalized(observed), sorted(proc.stdout.splitlines()))
    ours, console = results["torchdist"]
    assert ours["binary_ok"]["context"] == "SubprocessContext"
    assert ours["function_ok"]["context"] == "MultiprocessContext"
    assert ours["function_ok"]["return_values"] == {"0": 9, "1": 16}
    assert ours["function_fails"]["failures"] == {"0": [1, 0, "ValueError: bad"]}
    assert "[bin1]:hello b" in console and "[fn1]:square 4 on 1" in console
    assert results["torchdist"] == results["torch"]
