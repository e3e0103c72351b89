"""Run ``python -m torchdist.run`` as a user would, and check that nothing is left behind."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

WORKER = str(Path(__file__).with_name("worker.py"))


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without launcher settings that would leak into the run."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "TORCHELASTIC_", "TORCHDIST_SECRET", "OMP_NUM_THREADS"))}
    env.update(extra)
    return env


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str


class Launcher:
    """One ``torchdist-run`` process; optionally inside a network namespace."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, netns: str | None = None) -> None:
        cmd = [sys.executable, "-m", "torchdist.run", *args]
        if netns is not None:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        self.proc = subprocess.Popen(cmd, env=env if env is not None else clean_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def finish(self, timeout: float = 40.0) -> Finished:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            out, err = self.proc.communicate()
            raise AssertionError(f"the launcher did not finish within {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
        return Finished(self.proc.returncode, out, err)

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_launcher(*args: str, env: dict[str, str] | None = None, timeout: float = 40.0) -> Finished:
    launcher = Launcher(*args, env=env)
    try:
        return launcher.finish(timeout)
    finally:
        launcher.kill()


def records(outdir: Path, pattern: str = "rank*.json") -> list[dict]:
    """What the workers wrote about themselves, sorted by rank then attempt."""
    result = []
    for path in sorted(glob.glob(str(outdir / pattern))):
        with open(path) as fp:
            result.append(json.load(fp))
    return sorted(result, key=lambda r: (int(r.get("RANK", 0)), int(r.get("TORCHELASTIC_RESTART_COUNT", 0))))


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def is_alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fp:
            state = fp.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def assert_no_orphans(pids: list[int], timeout: float = 5.0) -> None:
    """Every pid in ``pids`` is gone within ``timeout`` (killed if not, so the suite stays clean)."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if is_alive(pid)]
        time.sleep(0.05)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not alive, f"worker processes left behind: {alive}"
