"""The worker-process layer under the launcher (``elastic.multiprocessing``), driven directly."""

import os
import sys

from torchdist.elastic.multiprocessing import Std, WorkerCommand, start_processes


def _command(tmp_path, local_rank: int, code: str, redirect: Std = Std.NONE, tee: Std = Std.NONE) -> WorkerCommand:
    return WorkerCommand(local_rank=local_rank, argv=(sys.executable, "-c", code), env=dict(os.environ),
                         log_dir=str(tmp_path / str(local_rank)), redirect=redirect, tee=tee, quiet=True)


def test_result_names_each_ranks_log_files_as_pytorchs_does(tmp_path):
    """RunProcsResult.stdouts/stderrs map local rank to its log file, "" where a stream is not redirected."""
    code = "import sys; print('out'); print('err', file=sys.stderr)"
    context = start_processes("logs", [_command(tmp_path, 0, code, redirect=Std.OUT),
                                       _command(tmp_path, 1, code, tee=Std.ALL)])
    try:
        result = context.wait(timeout=60)
    finally:
        context.close()
    assert result is not None and not result.is_failed()
    assert result.return_values == {0: None, 1: None}
    assert result.stdouts == {0: str(tmp_path / "0" / "stdout.log"), 1: str(tmp_path / "1" / "stdout.log")}
    assert result.stderrs == {0: "", 1: str(tmp_path / "1" / "stderr.log")}
    assert open(result.stdouts[0]).read() == "out\n"
    assert open(result.stderrs[1]).read() == "err\n"


def test_a_failed_run_still_names_the_log_files(tmp_path):
    context = start_processes("fails", [_command(tmp_path, 0, "raise SystemExit(3)", redirect=Std.ERR)])
    try:
        result = context.wait(timeout=60)
    finally:
        context.close()
    assert result.is_failed() and result.failures[0].exitcode == 3
    assert result.stderrs == {0: str(tmp_path / "0" / "stderr.log")} and result.stdouts == {0: ""}
