"""The DDP examples run to completion on 2 ranks (launched with torchrun-style environment variables)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from torchdist.testing import free_port

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _launch(script: str, args: list[str], nproc: int, cwd: pathlib.Path, timeout: float = 60) -> list[str]:
    """Start ``nproc`` ranks as ``torchdist-run`` would (RANK, WORLD_SIZE, MASTER_*); return their stdout."""
    port = free_port()
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(EXAMPLES / script), *args], env=env, cwd=cwd,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            outputs.append(out)
            assert proc.returncode == 0, f"{script} rank exited with {proc.returncode}:\n{out}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outputs


def test_digits_trains_checkpoints_and_resumes(tmp_path):
    pytest.importorskip("sklearn")
    ckpt = str(tmp_path / "digits.pt")
    first = _launch("ddp_digits.py", ["--epochs", "1", "--checkpoint", ckpt, "--no-progress"], 2, tmp_path)[0]
    assert "epoch   1" in first and "final test accuracy" in first, first
    resumed = _launch("ddp_digits.py", ["--epochs", "3", "--checkpoint", ckpt, "--resume", "--no-progress"], 2,
                      tmp_path)[0]
    assert "resumed from" in resumed and "epoch   2" in resumed and "epoch   1 " not in resumed, resumed
    accuracy = float(resumed.split("final test accuracy: ")[1].split()[0])
    assert accuracy > 0.7, resumed
    assert "identical on all 2 ranks: True" in resumed


@pytest.mark.parametrize("script,args,expect", [
    ("ddp_no_sync.py", ["--steps", "5"], "max |w - w_true|"),
    ("ddp_comm_hook.py", ["--steps", "15", "--hook", "powersgd"], "PowerSGD:"),
    ("ddp_join.py", [], "replicas identical after join: True"),
])
def test_feature_examples(tmp_path, script, args, expect):
    out = _launch(script, args, 2, tmp_path)[0]
    assert expect in out, out
