"""The worker-process layer under the launcher (``elastic.multiprocessing``), driven through torch's API."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from torchdist.elastic.multiprocessing import (
    DefaultLogsSpecs,
    MultiprocessContext,
    ProcessFailure,
    Std,
    SubprocessContext,
    start_processes,
)

pytestmark = pytest.mark.timeout(60)

CODE = "import sys; print('out'); print('err', file=sys.stderr)"


def _python(tmp_path, codes: list[str], redirects=Std.NONE, tee=Std.NONE, **kwargs):
    """``python -c code`` per local rank, logs under ``tmp_path``."""
    specs = DefaultLogsSpecs(log_dir=str(tmp_path), redirects=redirects, tee=tee, **kwargs.pop("specs", {}))
    args = {rank: ("-c", code) for rank, code in enumerate(codes)}
    envs = {rank: {"TORCHELASTIC_RUN_ID": "job"} for rank in args}
    return start_processes("trainer", sys.executable, args, envs, specs, **kwargs)


def _finish(context):
    try:
        return context.wait(timeout=30, period=0.05)
    finally:
        context.close()


def test_result_names_each_ranks_log_files_as_pytorchs_does(tmp_path):
    """RunProcsResult.stdouts/stderrs map local rank to its log file, "" where a stream is not redirected."""
    context = _python(tmp_path, [CODE, CODE], redirects={0: Std.OUT}, tee={1: Std.ALL})
    assert isinstance(context, SubprocessContext)
    result = _finish(context)
    assert result is not None and not result.is_failed()
    assert result.return_values == {0: None, 1: None}
    (run_dir,) = tmp_path.glob("job_*")
    attempt = run_dir / "attempt_0"
    assert result.stdouts == {0: str(attempt / "0" / "stdout.log"), 1: str(attempt / "1" / "stdout.log")}
    assert result.stderrs == {0: "", 1: str(attempt / "1" / "stderr.log")}
    assert open(result.stdouts[0]).read() == "out\n"
    assert open(result.stderrs[1]).read() == "err\n"


def test_tee_echoes_prefixed_lines_and_writes_the_file(tmp_path, capfd):
    result = _finish(_python(tmp_path, [CODE], tee=Std.OUT, log_line_prefixes={0: "[trainer0]:"}))
    assert "[trainer0]:out\n" in capfd.readouterr().out
    assert open(result.stdouts[0]).read() == "out\n"


def test_a_failed_binary_is_a_process_failure_and_stops_the_others(tmp_path):
    context = _python(tmp_path, ["raise SystemExit(3)", "import time; time.sleep(60)"], redirects=Std.ERR)
    result = _finish(context)
    assert result.is_failed() and list(result.failures) == [0]
    failure = result.failures[0]
    assert isinstance(failure, ProcessFailure) and failure.exitcode == 3 and failure.local_rank == 0
    assert failure.error_file.endswith(os.path.join("attempt_0", "0", "error.json"))
    assert result.stderrs[0].endswith("stderr.log") and result.stdouts == {0: "", 1: ""}
    assert context.subprocess_handlers[1].proc.returncode == -signal.SIGTERM  # wait() stopped the other rank


def _square(x: int) -> int:
    print(f"rank {os.environ['LOCAL_RANK']} squares {x}")
    return x * x


def _fail(message: str) -> None:
    raise ValueError(message)


def test_a_function_returns_its_values_by_local_rank(tmp_path):
    specs = DefaultLogsSpecs(log_dir=str(tmp_path), redirects=Std.OUT)
    envs = {0: {"LOCAL_RANK": "0"}, 1: {"LOCAL_RANK": "1"}}
    context = start_processes("sq", _square, {0: (3,), 1: (4,)}, envs, specs)
    assert isinstance(context, MultiprocessContext)
    result = _finish(context)
    assert not result.is_failed() and result.return_values == {0: 9, 1: 16}
    assert open(result.stdouts[1]).read() == "rank 1 squares 4\n"


def test_a_failing_function_reports_its_traceback(tmp_path):
    specs = DefaultLogsSpecs(log_dir=str(tmp_path), redirects=Std.ALL)
    result = _finish(start_processes("f", _fail, {0: ("boom",)}, {0: {}}, specs))
    failure = result.failures[0]
    assert failure.exitcode == 1 and failure.has_error_file()
    assert failure.message["message"] == "ValueError: boom" and "_fail" in failure.text()


def test_local_ranks_filter_silences_the_other_ranks(tmp_path, capfd):
    _finish(_python(tmp_path, [CODE, CODE], tee=Std.ALL, log_line_prefixes={0: "[0]:", 1: "[1]:"},
                    specs={"local_ranks_filter": {1}}))
    out = capfd.readouterr().out
    assert "[1]:out" in out and "[0]:" not in out


def test_mismatched_args_and_envs_are_an_error(tmp_path):
    with pytest.raises(RuntimeError, match="envs, local rank mapping mismatch"):
        start_processes("x", sys.executable, {0: (), 1: ()}, {0: {}}, DefaultLogsSpecs(str(tmp_path)))
    with pytest.raises(ValueError, match="start_method"):
        start_processes("x", _square, {0: (1,)}, {0: {}}, DefaultLogsSpecs(str(tmp_path)), start_method="thread")


def test_default_logs_specs_rejects_a_file_and_compares_by_settings(tmp_path):
    path = tmp_path / "f"
    path.write_text("")
    with pytest.raises(NotADirectoryError):
        DefaultLogsSpecs(log_dir=str(path))
    assert DefaultLogsSpecs(str(tmp_path), Std.OUT) == DefaultLogsSpecs(str(tmp_path), Std.OUT)
    assert DefaultLogsSpecs(str(tmp_path), Std.OUT) != DefaultLogsSpecs(str(tmp_path), Std.ERR)
