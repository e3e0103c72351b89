"""Two nodes in two network namespaces joined by a veth pair; one is killed and the job goes on.

The test makes the namespaces and the veth pair itself and removes them after. It
is skipped, saying why, only where the machine does not allow network namespaces
(not root, no ``ip``, or the kernel refuses).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from .launch_helpers import WORKER, Launcher, assert_no_orphans, clean_env, records, wait_for

pytestmark = pytest.mark.timeout(90)


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


def _netns_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "the 'ip' tool (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"tdprobe{os.getpid()}"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return f"this machine does not allow network namespaces: {made.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


@pytest.fixture
def two_namespaces():
    """Namespaces A and B, linked by a veth pair: A is 10.213.N.1, B is 10.213.N.2."""
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    tag = os.getpid() % 100000
    ns_a, ns_b = f"tdA{tag}", f"tdB{tag}"
    veth_a, veth_b = f"tdva{tag}", f"tdvb{tag}"
    subnet = f"10.213.{tag % 250}"
    try:
        steps = [
            ("netns", "add", ns_a), ("netns", "add", ns_b),
            ("link", "add", veth_a, "type", "veth", "peer", "name", veth_b),
            ("link", "set", veth_a, "netns", ns_a), ("link", "set", veth_b, "netns", ns_b),
            ("-n", ns_a, "addr", "add", f"{subnet}.1/24", "dev", veth_a),
            ("-n", ns_b, "addr", "add", f"{subnet}.2/24", "dev", veth_b),
            ("-n", ns_a, "link", "set", veth_a, "up"), ("-n", ns_b, "link", "set", veth_b, "up"),
            ("-n", ns_a, "link", "set", "lo", "up"), ("-n", ns_b, "link", "set", "lo", "up"),
        ]
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                pytest.skip(f"cannot set up the veth pair ('ip {' '.join(step)}'): {done.stderr.strip()}")
        yield (ns_a, f"{subnet}.1"), (ns_b, f"{subnet}.2")
    finally:
        _ip("netns", "del", ns_a)  # deleting a namespace deletes its end of the veth pair, and so the pair
        _ip("netns", "del", ns_b)
        _ip("link", "del", veth_a)


def test_node_killed_under_elastic_nnodes_job_continues(tmp_path, two_namespaces):
    (ns_a, addr_a), (ns_b, addr_b) = two_namespaces
    env = clean_env(TORCHDIST_SECRET="netns-test-secret", LOGLEVEL="INFO")
    conf = "last_call_timeout=3,keep_alive_interval=0.3,keep_alive_max_attempt=3,join_timeout=40"
    common = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
              f"{addr_a}:29400", "--rdzv-id", "netns-job", "--rdzv-conf", conf, "--monitor-interval", "0.1"]
    node_a = Launcher(*common, "--local-addr", addr_a, WORKER, "elastic", str(tmp_path), env=env, netns=ns_a)
    node_b = Launcher(*common, "--local-addr", addr_b, WORKER, "elastic", str(tmp_path), env=env, netns=ns_b)
    try:
        both = lambda: {r["world"] for r in records(tmp_path, "joined*.world2.*.json")} == {2} and len(  # noqa: E731
            records(tmp_path, "joined*.world2.*.json")) >= 2
        wait_for(both, 40, "both nodes' workers to meet in one world of 2")
        world2 = [r for r in records(tmp_path) if r["WORLD_SIZE"] == "2"]
        assert {r["MASTER_ADDR"] for r in world2} == {addr_a}
        assert sorted(r["GROUP_RANK"] for r in world2[-2:]) == ["0", "1"]
        b_workers = [r["pid"] for r in world2 if r["GROUP_RANK"] == "1"]
        (tmp_path / "peer-killed").write_text("1")
        os.kill(node_b.pid, signal.SIGKILL)  # the node dies: launcher and (by PDEATHSIG) its workers
        node_b.proc.wait(10)
        killed_at = time.monotonic()
        done_a = node_a.finish(45)
    finally:
        node_a.kill(), node_b.kill()
    assert done_a.returncode == 0, done_a.stderr
    assert "left or stopped sending heartbeats" in done_a.stderr
    finished = records(tmp_path, "done*.json")
    assert finished and {f["world"] for f in finished} == {1}, "the survivor went on alone"
    assert time.monotonic() - killed_at < 45
    assert_no_orphans(b_workers + [r["pid"] for r in records(tmp_path)])


def _start_two_nodes(namespaces, nproc: int, rdzv_id: str, *args: str) -> tuple[Launcher, Launcher]:
    """``torchdist-run`` in each namespace: one job of two nodes, ``nproc`` workers each."""
    (ns_a, addr_a), (ns_b, addr_b) = namespaces
    common = ["--nnodes", "2", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint",
              f"{addr_a}:29400", "--rdzv-id", rdzv_id, "--max-restarts", "0"]
    env = clean_env(TORCHDIST_SECRET="netns-test-secret")
    return (Launcher(*common, "--local-addr", addr_a, *args, env=env, netns=ns_a),
            Launcher(*common, "--local-addr", addr_b, *args, env=env, netns=ns_b))


def _run_two_nodes(namespaces, nproc: int, rdzv_id: str, *args: str, timeout: float = 60) -> str:
    """Run the job to its end on both nodes (both must succeed); node A's stdout."""
    node_a, node_b = _start_two_nodes(namespaces, nproc, rdzv_id, *args)
    try:
        done_a, done_b = node_a.finish(timeout), node_b.finish(timeout)
    finally:
        node_a.kill(), node_b.kill()
    assert done_a.returncode == 0, done_a.stderr
    assert done_b.returncode == 0, done_b.stderr
    return done_a.stdout


def test_default_backend_spans_two_namespaces(tmp_path, two_namespaces):
    """Two "hosts" (namespaces, each with its own mount namespace too) of two ranks each:
    the default backend is the hierarchical one, its TCP mesh reaches across the veth
    pair, and every collective's values are right on every rank."""
    _run_two_nodes(two_namespaces, 2, "netns-hosts", WORKER, "hosts", str(tmp_path))
    results = records(tmp_path, "hosts*.json")
    assert len(results) == 4
    world, big = 4, (1 << 18) + 5
    for result in results:
        assert result["backend"] == "HierarchicalBackend"
        assert result["sums"] == [float(world * 1 + 6), float(world * (big - 1) + 6)]
        assert result["gathered"] == [[r * 10] * 3 for r in range(world)]
        assert result["broadcast"] == 100 + world - 1
    full = sum(torch.arange(2 * world, dtype=torch.float32) * (r + 1) for r in range(world))
    assert [r["scattered"] for r in results] == [full[2 * r:2 * r + 2].tolist() for r in range(world)]


def test_a_cut_link_between_hosts_raises_on_every_rank_within_the_timeout(tmp_path, two_namespaces):
    """The hosts stay up but the link between them goes down (no reset, no close: a
    partition): every rank's all-reduce raises a DistError near the group's timeout,
    naming the op, instead of waiting for ever."""
    ns_b = two_namespaces[1][0]
    timeout_s = 4.0
    node_a, node_b = _start_two_nodes(two_namespaces, 2, "netns-cut", WORKER, "partition", str(tmp_path),
                                      str(timeout_s))
    try:
        wait_for(lambda: len(records(tmp_path, "ready*.json")) == 4, 40, "the four ranks to form the group")
        veth_b = _ip("-n", ns_b, "-o", "link", "show", "type", "veth").stdout.split(":")[1].strip().split("@")[0]
        assert _ip("-n", ns_b, "link", "set", veth_b, "down").returncode == 0
        (tmp_path / "cut").write_text("1")
        wait_for(lambda: len(records(tmp_path, "partition*.json")) == 4, 4 * timeout_s + 20,
                 "every rank to give up on the all-reduce")
    finally:
        node_a.kill(), node_b.kill()
    for outcome in records(tmp_path, "partition*.json"):
        assert outcome["raised"] in ("DistBackendError", "DistNetworkError", "DistError", "TimeoutError"), outcome
        assert "all_reduce" in outcome["message"] or "allreduce" in outcome["message"], outcome
        assert outcome["seconds"] < 3 * timeout_s, outcome


def test_rpc_across_two_namespaces(tmp_path, two_namespaces):
    """One RPC worker per "host": calls, an RRef and a distributed backward cross the
    veth pair, and the same-host upgrade (Unix sockets) is not taken between hosts."""
    _run_two_nodes(two_namespaces, 1, "netns-rpc", WORKER, "rpc", str(tmp_path))
    results = records(tmp_path, "rpc*.json")
    assert [r["added"] for r in results] == [[1.0] * 3, [2.0] * 3]
    for result in results:
        assert result["owned"] == [0.0, 2.0, 4.0]
        assert result["grad"] == [3.0, 3.0]
        assert result["families"] == ["AF_INET"]


def test_the_main_job_trains_across_two_namespaces(tmp_path, two_namespaces):
    """examples/ddp_digits.py on two "hosts" of two ranks each (hierarchical all-reduce
    over the veth pair): it trains, and rank 0 saves the checkpoint."""
    example = str(Path(__file__).parents[2] / "examples" / "ddp_digits.py")
    checkpoint = tmp_path / "digits.pt"
    stdout = _run_two_nodes(two_namespaces, 2, "netns-ddp", example, "--epochs", "2", "--no-progress",
                            "--checkpoint", str(checkpoint), timeout=80)
    assert "4 ranks" in stdout
    final = next(line for line in stdout.splitlines() if line.startswith("final test accuracy"))
    assert "identical on all 4 ranks: True" in final
    assert float(final.split()[3]) > 0.2  # ten classes: better than guessing after two epochs
    assert checkpoint.exists()
