"""``breakpoint(rank)`` (a debugger on one rank, the others waiting) and ``get_backend_config``."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import time

import torchdist as dist
from torchdist._c10d.world import WORLD
from torchdist.testing import run_ranks


def _debugged(rank: int, world: int, commands: str) -> tuple[str, float, list[float]]:
    """Rank 0 stops twice at one call site with skip=1 (so only the second call stops) and types
    ``commands`` at the prompt through /dev/stdin; every rank reports the output, its wait and the
    groups' timeouts after the call."""
    with tempfile.TemporaryFile("w+") as typed:
        typed.write(commands)
        typed.flush()
        typed.seek(0)
        os.dup2(typed.fileno(), 0)  # /dev/stdin is now the typed commands
    dist.new_group([0, 1])
    marker = f"frame-of-rank-{rank}"
    assert marker  # the debugger prints it from this frame
    output = io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stdout(output):
        for _ in range(2):
            dist.breakpoint(rank=0, skip=1, timeout_s=1234)
    waited = time.monotonic() - start
    return output.getvalue(), waited, [group.timeout.total_seconds() for group in WORLD.groups.values()]


def test_breakpoint_stops_one_rank_while_the_others_wait() -> None:
    commands = "up\np marker\n!import time; time.sleep(1.0)\nc\n"
    results = run_ranks(_debugged, 2, args=(commands,), backend="gloo", timeout=60)
    (out0, waited0, timeouts0), (out1, waited1, timeouts1) = results
    assert "'frame-of-rank-0'" in out0, out0  # 'up' reached the caller's frame
    assert out0.count("ATTENTION") == 1, out0  # skip=1: the first call from that line did not stop
    assert out1 == ""  # rank 1 never entered the debugger ...
    assert waited1 >= 0.9, waited1  # ... but waited for rank 0's session (the sleep typed there)
    assert timeouts0 == timeouts1 == [1234.0, 1234.0]  # both groups: nobody times out while typing


def _configs(rank: int, world: int) -> list[str]:
    tcp = dist.new_group(list(range(world)), backend="cpu:tcp")
    return [dist.get_backend_config(), dist.get_backend_config(tcp), str(dist.get_backend(tcp))]


def test_get_backend_config_names_the_cpu_backend() -> None:
    assert run_ranks(_configs, 2, backend="gloo", timeout=60) == [["cpu:gloo", "cpu:tcp", "cpu:tcp"]] * 2
