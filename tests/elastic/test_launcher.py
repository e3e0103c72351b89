"""torchdist-run end to end: the worker environment, failures, restarts, signals, two nodes on loopback.

Each test starts ``python -m torchdist.run`` as a subprocess, as a user would; the
workers (tests/elastic/worker.py) write what they saw, and every test checks by pid
that no worker outlives its launcher.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from torchdist.testing import free_port

from .launch_helpers import WORKER, Launcher, assert_no_orphans, clean_env, records, run_launcher, wait_for

pytestmark = pytest.mark.timeout(60)


def _pids(outdir) -> list[int]:
    return [r["pid"] for r in records(outdir)]


def test_single_node_environment(tmp_path):
    done = run_launcher("--standalone", "--nproc-per-node", "2", WORKER, "env", str(tmp_path), "${local_rank}")
    assert done.returncode == 0, done.stderr
    recs = records(tmp_path)
    assert [r["RANK"] for r in recs] == ["0", "1"]
    for i, r in enumerate(recs):
        assert r["LOCAL_RANK"] == str(i) and r["ROLE_RANK"] == str(i)
        assert r["WORLD_SIZE"] == r["LOCAL_WORLD_SIZE"] == r["ROLE_WORLD_SIZE"] == "2"
        assert r["GROUP_RANK"] == "0" and r["GROUP_WORLD_SIZE"] == "1"
        assert r["ROLE_NAME"] == "default"
        assert r["MASTER_ADDR"] == "localhost" and int(r["MASTER_PORT"]) > 0
        assert r["TORCHELASTIC_RESTART_COUNT"] == "0" and r["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert r["TORCHELASTIC_USE_AGENT_STORE"] == "True" and r["TORCHELASTIC_RUN_ID"]
        assert r["TORCHELASTIC_ERROR_FILE"].endswith(f"attempt_0/{i}/error.json")
        assert r["OMP_NUM_THREADS"] == "1"
        assert r["has_secret"], "the launcher hands a per-job secret to its workers"
        assert r["argv"][-1] == str(i), "${local_rank} is replaced in the script's arguments"
    assert "Setting OMP_NUM_THREADS environment variable for each process to be 1" in done.stderr
    assert_no_orphans(_pids(tmp_path))


def test_two_static_nodes_form_one_world(tmp_path):
    port = free_port()
    env = clean_env(TORCHDIST_SECRET="two-node-test-secret")
    common = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    node1 = Launcher(*common, "--node-rank", "1", "--nproc-per-node", "2", WORKER, "barrier", str(tmp_path), env=env)
    node0 = Launcher(*common, "--node-rank", "0", "--nproc-per-node", "1", WORKER, "barrier", str(tmp_path), env=env)
    try:
        done0, done1 = node0.finish(), node1.finish()
    finally:
        node0.kill(), node1.kill()
    assert done0.returncode == 0, done0.stderr
    assert done1.returncode == 0, done1.stderr
    recs = records(tmp_path)
    assert [r["RANK"] for r in recs] == ["0", "1", "2"]
    assert [r["GROUP_RANK"] for r in recs] == ["0", "1", "1"]
    assert [r["LOCAL_RANK"] for r in recs] == ["0", "0", "1"]
    assert [r["LOCAL_WORLD_SIZE"] for r in recs] == ["1", "2", "2"]
    assert {r["WORLD_SIZE"] for r in recs} == {"3"} and {r["GROUP_WORLD_SIZE"] for r in recs} == {"2"}
    assert {(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in recs} == {("127.0.0.1", str(port))}
    assert "OMP_NUM_THREADS" not in done0.stderr, "one worker per node needs no OMP notice"
    assert_no_orphans(_pids(tmp_path))


def test_two_c10d_nodes_init_process_group(tmp_path):
    endpoint = f"localhost:{free_port()}"
    env = clean_env(TORCHDIST_SECRET="c10d-test-secret")
    args = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-id", "job-c10d", WORKER, "pg", str(tmp_path)]
    nodes = [Launcher(*args, env=env), Launcher(*args, env=env)]
    try:
        results = [node.finish(60) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for result in results:
        assert result.returncode == 0, result.stderr
    recs = records(tmp_path)
    assert sorted(r["GROUP_RANK"] for r in recs) == ["0", "1"]
    assert {r["TORCHELASTIC_RUN_ID"] for r in recs} == {"job-c10d"}
    pg = records(tmp_path, "pg*.json")
    assert sorted(p["rank"] for p in pg) == [0, 1]
    assert {p["sum"] for p in pg} == {2.0} and {p["world"] for p in pg} == {2}
    assert_no_orphans(_pids(tmp_path))


def test_worker_exception_fails_the_job_with_summary(tmp_path):
    done = run_launcher("--nproc-per-node", "2", "--master-port", str(free_port()), WORKER, "raise", str(tmp_path))
    assert done.returncode == 1
    err = done.stderr
    assert "ChildFailedError" in err and "worker.py FAILED" in err
    root = err.split("Root Cause (first observed failure):", 1)[1]
    assert "rank      : 1 (local_rank: 1)" in root
    assert "exitcode  : 1 (pid: " in root
    assert "error_file: " in root and "attempt_0/1/error.json" in root
    assert "ValueError: boom from rank 1" in root and "Traceback" in root
    assert "host      : " in root and "time      : " in root
    assert "Sending process" in err, "the surviving worker is stopped, and the launcher says so"
    assert_no_orphans(_pids(tmp_path))


def test_run_path_records_tracebacks_and_the_launcher_leaves_its_own_error_file(tmp_path):
    """As torchrun: --run-path runs the script under @record, and the launcher copies the
    root cause's error file to its own TORCHELASTIC_ERROR_FILE (for whatever launched it)."""
    own = tmp_path / "launcher-error.json"
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(own)}
    done = run_launcher("--nproc-per-node", "2", "--run-path", "--master-port", str(free_port()), WORKER,
                        "raise-plain", str(tmp_path), env=env)
    assert done.returncode == 1
    root = done.stderr.split("Root Cause (first observed failure):", 1)[1]
    assert "ValueError: plain boom from rank 1" in root and "Traceback" in root, root
    copied = json.loads(own.read_text())["message"]
    assert copied["message"] == "ValueError: plain boom from rank 1" and copied["errorCode"] == 1
    assert_no_orphans(_pids(tmp_path))


def test_worker_exit_code_is_reported(tmp_path):
    done = run_launcher("--nproc-per-node", "2", "--master-port", str(free_port()), WORKER, "exit", str(tmp_path), "0")
    assert done.returncode == 1
    root = done.stderr.split("Root Cause (first observed failure):", 1)[1]
    assert "rank      : 0 (local_rank: 0)" in root and "exitcode  : 7" in root
    assert "error_file: <N/A>" in root and "record" in root
    assert_no_orphans(_pids(tmp_path))


def test_missing_executable_fails_like_a_shell(tmp_path):
    done = run_launcher("--no-python", "--master-port", str(free_port()), str(tmp_path / "no-such-program"))
    assert done.returncode == 1
    assert "exitcode  : 127" in done.stderr and "No such file or directory" in done.stderr


def test_max_restarts_restarts_the_group(tmp_path):
    done = run_launcher("--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.05",
                        "--master-port", str(free_port()), WORKER, "fail-once", str(tmp_path))
    assert done.returncode == 0, done.stderr
    recs = records(tmp_path)
    attempts = sorted((r["RANK"], r["TORCHELASTIC_RESTART_COUNT"]) for r in recs)
    assert ("1", "0") in attempts, "rank 1 ran (and failed) on the first attempt"
    assert ("0", "1") in attempts and ("1", "1") in attempts, "both ranks ran again with RESTART_COUNT=1"
    assert {r["TORCHELASTIC_MAX_RESTARTS"] for r in recs} == {"1"}
    assert_no_orphans(_pids(tmp_path))


def _two_static_nodes(flags: list[str], worker_args: list[str]):
    """Run two launchers (node ranks 0 and 1, one worker each) to their end."""
    env = clean_env(TORCHDIST_SECRET="two-nodes-secret")
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-port", str(free_port()), *flags]
    nodes = [Launcher(*common, "--node-rank", str(rank), WORKER, *worker_args, env=env) for rank in (0, 1)]
    try:
        return [node.finish() for node in nodes]
    finally:
        for node in nodes:
            node.kill()


def test_failure_on_one_node_stops_the_other(tmp_path):
    done0, done1 = _two_static_nodes([], ["exit", str(tmp_path), "1"])
    assert done1.returncode == 1 and "exitcode  : 7" in done1.stderr
    assert done0.returncode == 1, "the node whose workers were fine fails the job too"
    root = done0.stderr.split("Root Cause (first observed failure):", 1)[1]
    assert "rank      : 1 (local_rank: 0)" in root and "exitcode  : 7" in root
    assert "The job failed on node" in done0.stderr
    assert_no_orphans(_pids(tmp_path))


def test_restart_counts_are_per_node(tmp_path):
    """As torchrun: rank 1's node fails once and spends its restart; node 0 restarts with it
    but spends none (its workers still see TORCHELASTIC_RESTART_COUNT=0)."""
    done0, done1 = _two_static_nodes(["--max-restarts", "1", "--monitor-interval", "0.05"],
                                     ["fail-once", str(tmp_path), "barrier"])
    assert done0.returncode == 0 and done1.returncode == 0, (done0.stderr, done1.stderr)
    counts = sorted((r["RANK"], r["TORCHELASTIC_RESTART_COUNT"]) for r in records(tmp_path))
    assert counts == [("0", "0"), ("0", "0"), ("1", "0"), ("1", "1")], counts
    assert_no_orphans(_pids(tmp_path))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_launcher_stops_every_worker(tmp_path, sig):
    launcher = Launcher("--nproc-per-node", "2", "--master-port", str(free_port()), WORKER, "sleep", str(tmp_path),
                        "60", env=clean_env())
    try:
        wait_for(lambda: len(records(tmp_path)) == 2, 20, "both workers to start")
        os.kill(launcher.pid, sig)
        done = launcher.finish(20)
    finally:
        launcher.kill()
    assert done.returncode == 1, done.stderr  # torchrun's status after a SignalException
    assert f"received {signal.Signals(sig).name}" in done.stderr
    assert_no_orphans(_pids(tmp_path))


def test_sigkill_of_launcher_takes_workers_down(tmp_path):
    launcher = Launcher("--nproc-per-node", "2", "--master-port", str(free_port()), WORKER, "sleep", str(tmp_path),
                        "60", env=clean_env())
    try:
        wait_for(lambda: len(records(tmp_path)) == 2, 20, "both workers to start")
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.proc.wait(10)
        assert_no_orphans(_pids(tmp_path))
    finally:
        launcher.kill()


def test_tee_prefixes_lines_and_writes_logs(tmp_path):
    logs = tmp_path / "logs"
    done = run_launcher("--nproc-per-node", "2", "--tee", "3", "--log-dir", str(logs), "--master-port",
                        str(free_port()), WORKER, "print", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "[default0]:hello from rank 0" in done.stdout.splitlines()
    assert "[default1]:hello from rank 1" in done.stdout.splitlines()
    assert "[default1]:complaint from rank 1" in done.stderr.splitlines()
    (stdout_log,) = logs.glob("*/attempt_0/1/stdout.log")
    assert stdout_log.read_text() == "hello from rank 1\n"
    assert_no_orphans(_pids(tmp_path))


def test_redirect_and_rank_prefix_template(tmp_path):
    logs = tmp_path / "logs"
    env = clean_env(TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[rank${rank}]:")
    done = run_launcher("--nproc-per-node", "2", "--redirects", "0:3", "--tee", "1:1", "--log-dir", str(logs),
                        "--master-port", str(free_port()), WORKER, "print", str(tmp_path), env=env)
    assert done.returncode == 0, done.stderr
    assert "hello from rank 0" not in done.stdout, "rank 0's output only goes to its files"
    assert "[rank1]:hello from rank 1" in done.stdout.splitlines()
    (err_log,) = logs.glob("*/attempt_0/0/stderr.log")
    assert err_log.read_text() == "complaint from rank 0\n"
    assert_no_orphans(_pids(tmp_path))


def test_local_ranks_filter_shows_only_those_ranks(tmp_path):
    done = run_launcher("--nproc-per-node", "2", "--local-ranks-filter", "1", "--master-port", str(free_port()),
                        WORKER, "print", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["hello from rank 1"]  # as torchrun: untouched, no prefix
    assert_no_orphans(_pids(tmp_path))


def test_duplicate_filters_and_virtual_local_rank(tmp_path):
    logs = tmp_path / "logs"
    done = run_launcher("--nproc-per-node", "2", "--tee", "3", "--log-dir", str(logs), "--virtual-local-rank",
                        "--duplicate-stdout-filters", "rank 1,nothing", "--master-port", str(free_port()),
                        WORKER, "print", str(tmp_path))
    assert done.returncode == 0, done.stderr
    (filtered,) = logs.glob("*/attempt_0/filtered_stdout.log")
    assert filtered.read_text().splitlines() == ["[default1]:hello from rank 1"]
    assert {r["LOCAL_RANK"] for r in records(tmp_path)} == {"0"}  # every worker sees LOCAL_RANK=0
    assert_no_orphans(_pids(tmp_path))


@pytest.mark.parametrize("flags", [["--event-log-handler", "null"], ["--logs-specs", "default"]])
def test_torchrun_flags_without_effect_here_are_accepted(tmp_path, flags):
    done = run_launcher("--nproc-per-node", "1", *flags, "--master-port", str(free_port()), WORKER, "print",
                        str(tmp_path))
    assert done.returncode == 0, done.stderr


def test_store_refuses_connections_without_the_secret(tmp_path):
    done = run_launcher("--standalone", "--nproc-per-node", "1", WORKER, "no-secret", str(tmp_path))
    assert done.returncode == 0, done.stderr
    (outcome,) = records(tmp_path, "auth*.json")
    assert outcome["right"] == "ok"
    assert outcome["none"].startswith("AuthenticationError") and "TORCHDIST_SECRET" in outcome["none"]
    assert outcome["wrong"].startswith("AuthenticationError")
    assert_no_orphans(_pids(tmp_path))


def test_pet_environment_variables_set_flags(tmp_path):
    env = clean_env(PET_NPROC_PER_NODE="2", PET_STANDALONE="1")
    done = run_launcher(WORKER, "env", str(tmp_path), env=env)
    assert done.returncode == 0, done.stderr
    assert [r["WORLD_SIZE"] for r in records(tmp_path)] == ["2", "2"]
    assert_no_orphans(_pids(tmp_path))


_FUNCTION_LAUNCH = '''
import os, sys
import torch
import torchdist
from torchdist.elastic import ChildFailedError, LaunchConfig, elastic_launch


def train(offset, scale):
    torchdist.init_process_group()
    rank = torchdist.get_rank()
    t = torch.tensor([float(rank)])
    torchdist.all_reduce(t)
    torchdist.destroy_process_group()
    if scale is None:
        raise ValueError(f"no scale on rank {rank}")
    return {"rank": rank, "value": offset + scale * t.item()}


if __name__ == "__main__":
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, rdzv_backend="c10d",
                          rdzv_endpoint="127.0.0.1:" + sys.argv[1], max_restarts=0)
    print("returned", elastic_launch(config, train)(1, 10))
    try:
        elastic_launch(config, train)(1, None)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        print("failed", exc.name, "no scale on rank" in str(failure.message))
'''


def test_elastic_launch_runs_a_function_defined_in_the_script_and_returns_each_ranks_value(tmp_path):
    script = tmp_path / "launch_function.py"
    script.write_text(_FUNCTION_LAUNCH)
    done = subprocess.run([sys.executable, str(script), str(free_port())], env=clean_env(), capture_output=True,
                          text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert "returned {0: {'rank': 0, 'value': 11.0}, 1: {'rank': 1, 'value': 11.0}}" in done.stdout, done.stdout
    assert "failed train True" in done.stdout, done.stdout + done.stderr
