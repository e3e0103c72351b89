"""The launcher's configuration and error reporting, in-process: flags, PET_ variables, validation, @record."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

from torchdist.elastic import ChildFailedError, LaunchConfig, record
from torchdist.elastic.config import parse_min_max_nnodes, parse_nproc_per_node, parse_rdzv_conf, parse_signals
from torchdist.elastic.launch import job_secret
from torchdist.elastic.multiprocessing import ProcessFailure, Std
from torchdist.run import config_from_args, parse_args

pytestmark = pytest.mark.timeout(30)


def test_parsers():
    assert parse_min_max_nnodes("2") == (2, 2) and parse_min_max_nnodes("1:4") == (1, 4)
    with pytest.raises(ValueError, match="MIN:MAX"):
        parse_min_max_nnodes("1:2:3")
    assert parse_nproc_per_node("3") == 3 and parse_nproc_per_node("cpu") == os.cpu_count()
    with pytest.raises(ValueError, match="nproc_per_node"):
        parse_nproc_per_node("many")
    assert parse_rdzv_conf("a=1, b=x") == {"a": "1", "b": "x"}
    with pytest.raises(ValueError, match="key=value"):
        parse_rdzv_conf("oops")
    assert parse_signals("SIGTERM,SIGINT") == (signal.SIGTERM, signal.SIGINT)
    assert Std.from_str("3") == Std.ALL and Std.from_str("0:1,1:2") == {0: Std.OUT, 1: Std.ERR}
    with pytest.raises(ValueError, match="not a valid stream setting"):
        Std.from_str("7")


@pytest.mark.parametrize("field,value,message", [
    ("min_nodes", 0, "min_nodes must be >= 1"),
    ("nproc_per_node", 0, "nproc_per_node must be >= 1"),
    ("max_restarts", -1, "max_restarts must be >= 0"),
    ("monitor_interval", 0, "monitor_interval must be > 0"),
    ("start_method", "thread", "start_method must be one of"),
    ("tee", {5: Std.ALL}, "local ranks \\[5\\]"),
])
def test_launch_config_is_validated(field, value, message):
    kwargs = dict(min_nodes=1, max_nodes=1, nproc_per_node=2)
    kwargs[field] = value
    with pytest.raises(ValueError, match=message):
        LaunchConfig(**kwargs)


def test_launch_config_takes_torchs_defaults_and_forms():
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, signals_to_handle="SIGTERM,SIGUSR1")
    assert config.role == "default_role"
    assert config.signals_to_handle == (signal.SIGTERM, signal.SIGUSR1)  # a string, as torch's field is


def test_launch_config_is_frozen_and_hides_the_secret():
    config = LaunchConfig(min_nodes=1, max_nodes=2, nproc_per_node=1, secret="hunter2", rdzv_configs={"a": 1})
    assert "hunter2" not in repr(config) and config.is_multi_node
    with pytest.raises(AttributeError):
        config.nproc_per_node = 3
    with pytest.raises(TypeError):
        config.rdzv_configs["b"] = 2


def test_flags_follow_torchrun(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    args = parse_args(["--nnodes", "2", "--node_rank", "1", "--master-addr", "n0", "--nproc-per-node", "4",
                       "--max_restarts", "2", "-t", "3", "train.py", "--lr", "0.1"])
    config, cmd, cmd_args = config_from_args(args)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 4)
    assert config.rdzv_backend == "static" and config.rdzv_endpoint == "n0:29500"
    assert config.rdzv_configs["rank"] == 1 and config.max_restarts == 2 and config.tee == Std.ALL
    assert cmd == sys.executable and cmd_args == ["-u", "train.py", "--lr", "0.1"]
    assert os.environ["OMP_NUM_THREADS"] == "1"


def test_one_node_without_a_port_takes_a_free_one_as_torchrun_does():
    """torchrun 2.13: two one-node jobs side by side must not both claim port 29500."""
    config, _, _ = config_from_args(parse_args(["--nproc-per-node", "2", "train.py"]))
    assert config.rdzv_backend == "c10d" and config.rdzv_endpoint == "localhost:0" and config.run_id != "none"
    for named in (["--master-port", "29511"], ["--nnodes", "2"], ["--rdzv-endpoint", "h:1"]):
        config, _, _ = config_from_args(parse_args([*named, "--nproc-per-node", "2", "train.py"]))
        assert config.rdzv_backend == "static", named


def test_standalone_module_and_no_python(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    config, cmd, cmd_args = config_from_args(parse_args(["--standalone", "-m", "pkg.train", "x"]))
    assert config.rdzv_backend == "c10d" and config.rdzv_endpoint == "localhost:0" and config.run_id != "none"
    assert cmd_args == ["-u", "-m", "pkg.train", "x"]
    _, cmd, cmd_args = config_from_args(parse_args(["--no-python", "/bin/echo", "hi"]))
    assert (cmd, cmd_args) == ("/bin/echo", ["hi"])
    assert os.environ["OMP_NUM_THREADS"] == "3", "a user's OMP_NUM_THREADS is kept"


def test_pet_variables_are_defaults(monkeypatch):
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("PET_MAX_RESTARTS", "5")
    monkeypatch.setenv("PET_STANDALONE", "1")
    args = parse_args(["train.py"])
    assert (args.nproc_per_node, args.max_restarts, args.standalone) == ("3", 5, True)
    assert parse_args(["--max-restarts", "1", "train.py"]).max_restarts == 1, "a flag beats PET_"


def test_secret_file_and_job_secret_rules(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHDIST_SECRET", raising=False)
    secret_file = tmp_path / "secret"
    secret_file.write_text("from-file\n")
    config, _, _ = config_from_args(parse_args(["--secret-file", str(secret_file), "t.py"]))
    assert job_secret(config) == "from-file"
    single = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1)
    assert len(job_secret(single)) == 64, "one node: a fresh random secret"
    multi = LaunchConfig(min_nodes=1, max_nodes=2, nproc_per_node=1)
    assert job_secret(multi) is None, "several nodes cannot agree on a random secret"
    monkeypatch.setenv("TORCHDIST_SECRET", "shared")
    assert job_secret(multi) == "shared" and job_secret(single) == "shared"
    monkeypatch.setenv("TORCHDIST_SECRET", "")
    assert job_secret(single) is None, "an empty TORCHDIST_SECRET turns authentication off"


def test_record_writes_torchruns_error_file(tmp_path, monkeypatch):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))

    @record
    def main():
        raise KeyError("missing")

    with pytest.raises(KeyError):
        main()
    data = json.loads(error_file.read_text())["message"]
    assert data["message"] == "KeyError: 'missing'"
    assert "Traceback" in data["extraInfo"]["py_callstack"] and int(data["extraInfo"]["timestamp"]) > 0
    failure = ProcessFailure(local_rank=0, pid=123, exitcode=1, error_file=str(error_file))
    assert failure.has_error_file() and failure.message == data and "KeyError" in failure.text()  # torch: the dict

    @record
    def exits(code):
        sys.exit(code)

    error_file.unlink()
    assert exits(0) is None, "torchrun's record returns None for sys.exit(0)"
    with pytest.raises(SystemExit):
        exits(3)
    with pytest.raises(SystemExit):
        exits(None)  # a bare sys.exit(): torchrun's record re-raises it
    assert not error_file.exists(), "sys.exit is not an error"

    @record
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        interrupted()
    assert not error_file.exists(), "as torchrun's, only an Exception is recorded: Ctrl-C is reported as the signal"

    # a launcher's record: the root-cause worker's file becomes its own, with the exit code
    child_file = tmp_path / "child.json"
    child_file.write_text(json.dumps({"message": {"message": "ValueError: x", "extraInfo": {
        "py_callstack": "Traceback ...", "timestamp": "1"}}}))

    @record
    def launcher():
        raise ChildFailedError("train.py", {3: ProcessFailure(local_rank=1, pid=9, exitcode=-9,
                                                               error_file=str(child_file))})

    with pytest.raises(ChildFailedError):
        launcher()
    copied = json.loads(error_file.read_text())["message"]
    assert copied["message"] == "ValueError: x" and copied["errorCode"] == -9


def test_child_failed_error_names_the_first_failure():
    late = ProcessFailure(local_rank=1, pid=11, exitcode=-signal.SIGKILL, error_file="")
    first = ProcessFailure(local_rank=0, pid=10, exitcode=3, error_file="")
    first.timestamp = late.timestamp - 5
    err = ChildFailedError("train.py", {4: first, 5: late}, hosts={4: "n1", 5: "n1"})
    text = str(err)
    assert text.splitlines()[1] == "train.py FAILED"
    root = text.split("Root Cause (first observed failure):")[1]
    assert "rank      : 4 (local_rank: 0)" in root and "exitcode  : 3 (pid: 10)" in root and "n1" in root
    others = text.split("Failures:")[1].split("Root Cause")[0]
    assert "exitcode  : -9 (pid: 11) (SIGKILL)" in others and "Signal 9 (SIGKILL) received by PID 11" in others
    assert err.get_first_failure() == (4, first)


def test_elastic_imports_only_lower_layers():
    """The launcher sits on the stores and the auth primitives, never on process groups or collectives."""
    import ast
    import pathlib

    import torchdist

    package = pathlib.Path(torchdist.__file__).parent
    allowed = {"elastic", "_store", "_auth", "errors"}
    offenders = []
    for path in [package / "run.py", *sorted((package / "elastic").rglob("*.py"))]:
        depth = len(path.relative_to(package).parts) - 1
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                parts = path.relative_to(package).parent.parts[: depth - node.level + 1]
                target = [*parts, *(node.module.split(".") if node.module else [])]
                if target and target[0] not in allowed:
                    offenders.append(f"{path.name}: {'.'.join(target)}")
    assert not offenders, offenders
