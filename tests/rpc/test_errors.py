"""Remote exceptions, timeouts, async_execution, dead workers, graceful shutdown, authentication."""

from __future__ import annotations

import os
import time

import pytest
import torch

import torchdist.rpc as rpc
from torchdist.testing import RanksFailed, run_ranks

from ._common import name, start


def boom(x):
    raise ValueError(f"boom {x}")


class TwoArgError(Exception):
    def __init__(self, a, b):
        super().__init__(a, b)


def two_arg_error():
    raise TwoArgError(1, 2)


def sleep_then(seconds, value=None):
    time.sleep(seconds)
    return value


def _remote_exceptions(rank, world_size):
    start(rank, world_size)
    out = []
    if rank == 0:
        for call in (lambda: rpc.rpc_sync("worker1", boom, args=(1,)),
                     lambda: rpc.rpc_async("worker1", boom, args=(2,)).wait(),
                     lambda: rpc.remote("worker1", boom, args=(3,)).to_here(),
                     lambda: torch.futures.wait_all([rpc.rpc_async("worker1", sleep_then, args=(0, 1)),
                                                     rpc.rpc_async("worker1", boom, args=(4,))])):
            try:
                call()
                out.append(None)
            except Exception as exc:  # noqa: BLE001
                out.append((type(exc).__name__, str(exc)))
        try:
            rpc.rpc_sync("worker1", two_arg_error)
        except RuntimeError as exc:
            out.append(("RuntimeError", str(exc)))
    rpc.shutdown()
    return out


def test_remote_exceptions_keep_type_message_traceback_and_callee_name():
    out = run_ranks(_remote_exceptions, 2, timeout=30)[0]
    for i, (kind, message) in enumerate(out[:4], start=1):
        assert kind == "ValueError"
        assert message.startswith("On WorkerInfo(id=1, name=worker1):"), message
        assert f"boom {i}" in message and "Traceback (most recent call last)" in message
        assert 'test_errors.py", line' in message and "in boom" in message
    kind, message = out[4]
    assert "Failed to create original exception type" in message and "TwoArgError" in message


def exits(code):
    raise SystemExit(code)


def _base_exception(rank, world_size):
    start(rank, world_size)
    out = None
    if rank == 0:
        try:
            rpc.rpc_sync("worker1", exits, args=(3,), timeout=5)
        except RuntimeError as exc:
            out = str(exc)
        out = (out, rpc.rpc_sync("worker1", torch.add, args=(1, 2), timeout=5))
    rpc.shutdown()
    return out


def test_a_remote_system_exit_is_a_runtime_error_and_the_worker_keeps_serving():
    """A Future holds Exceptions only: a remote SystemExit (any BaseException) arrives
    as PyTorch's RuntimeError("SystemExit: ..."), and the connection stays usable."""
    message, after = run_ranks(_base_exception, 2, timeout=30)[0]
    assert message.startswith("SystemExit: ") and "SystemExit(3)" in message, message
    assert after == 3


def _timeouts(rank, world_size):
    start(rank, world_size, rpc_timeout=5.0)
    result = {}
    if rank == 0:
        t0 = time.monotonic()
        try:
            rpc.rpc_sync("worker1", sleep_then, args=(1.0,), timeout=0.2)
        except RuntimeError as exc:
            result["sync"] = (str(exc), time.monotonic() - t0)
        fut = rpc.rpc_async("worker1", sleep_then, args=(1.0,), timeout=0.2)
        try:
            fut.wait()
        except RuntimeError as exc:
            result["async"] = str(exc)
        rref = rpc.remote("worker1", sleep_then, args=(1.0, 5), timeout=0.2)
        try:
            rref.to_here(timeout=0.3)  # to_here's own timeout, while the creation still runs
        except RuntimeError as exc:
            result["to_here"] = str(exc)
        time.sleep(0.2)  # the creation timed out by now
        try:
            rref.to_here()
        except RuntimeError as exc:
            result["remote"] = str(exc)
        # a to_here() started before the creation's timeout waits for the value, as in PyTorch
        result["late value"] = rpc.remote("worker1", sleep_then, args=(0.5, 6), timeout=0.2).to_here()
        rpc._set_rpc_timeout(0.2)
        try:
            rpc.rpc_sync("worker1", sleep_then, args=(1.0,))
        except RuntimeError as exc:
            result["default"] = (rpc.get_rpc_timeout(), str(exc))
        result["infinite"] = rpc.rpc_sync("worker1", sleep_then, args=(0.4, 7), timeout=0)
        rpc._set_rpc_timeout(5.0)
        result["unset"] = rpc.rpc_sync("worker1", sleep_then, args=(0.1, 8), timeout=-1)  # UNSET: the default
        t0 = time.monotonic()
        try:
            rpc.rpc_sync("worker1", sleep_then, args=(1.0,), timeout=-5)  # already past, as in PyTorch
        except RuntimeError as exc:
            result["negative"] = (str(exc), time.monotonic() - t0)
    rpc.shutdown()
    return result


def test_timeouts_raise_runtime_error_like_pytorch():
    res = run_ranks(_timeouts, 2, timeout=40)[0]
    message, elapsed = res["sync"]
    assert message == "RPCErr:1:RPC ran for more than set timeout (200 ms) and will now be marked with an error"
    assert elapsed < 0.9
    assert res["async"] == message
    assert res["to_here"] == message.replace("200 ms", "300 ms")
    assert res["remote"] == ("RRef creation via rpc.remote() timed out, and it is possible that the RRef on the owner "
                             "node does not exist.")
    assert res["late value"] == 6
    assert res["default"] == (0.2, message)
    assert res["unset"] == 8
    negative, elapsed = res["negative"]
    assert negative == message.replace("200 ms", "-5000 ms") and elapsed < 0.5
    assert res["infinite"] == 7


@rpc.functions.async_execution
def async_add(to, x, y):
    return rpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() * 2)


@rpc.functions.async_execution
def async_nested(to, x):
    return rpc.rpc_async(to, async_add, args=(to, x, 1))


@rpc.functions.async_execution
def not_a_future():
    return 3


class AsyncHolder:
    @staticmethod
    @rpc.functions.async_execution
    def static_add(x, y):
        fut = torch.futures.Future()
        fut.set_result(x + y)
        return fut

    @classmethod
    @rpc.functions.async_execution
    def class_add(cls, x, y):
        fut = torch.futures.Future()
        fut.set_result(x + y + 100)
        return fut


def _async_execution(rank, world_size):
    start(rank, world_size)
    result = {}
    if rank == 0:
        result["chained"] = rpc.rpc_sync("worker1", async_add, args=("worker0", 1, 2))
        result["nested"] = rpc.rpc_sync("worker1", async_nested, args=("worker0", 1))
        result["remote"] = rpc.remote("worker1", async_add, args=("worker0", 2, 2)).to_here()
        result["static"] = rpc.rpc_sync("worker1", AsyncHolder.static_add, args=(1, 2))
        result["class"] = rpc.rpc_sync("worker1", AsyncHolder.class_add, args=(1, 2))
        try:
            rpc.rpc_sync("worker1", not_a_future)
        except RuntimeError as exc:
            result["bad"] = str(exc)
    rpc.shutdown()
    return result


def test_async_execution_replies_when_the_future_completes():
    res = run_ranks(_async_execution, 2, timeout=30)[0]
    assert res["chained"] == 6 and res["nested"] == 4 and res["remote"] == 8
    assert res["static"] == 3 and res["class"] == 103
    assert "must return a torch.futures.Future object, but got builtins.int" in res["bad"]


def _future_completes_once(rank, world_size):
    fut = torch.futures.Future()
    fut.set_result(1)
    try:
        fut.set_result(2)
    except RuntimeError as exc:
        return str(exc)


def test_future_can_be_completed_only_once():
    assert "Future can only be marked completed once" in _future_completes_once(0, 1)


def _dying_worker(rank, world_size):
    start(rank, world_size)
    if rank == 1:
        rpc.rpc_sync("worker0", sleep_then, args=(0,))  # make sure everything is up
        time.sleep(0.3)
        os._exit(3)  # dies while worker0 waits for its answers
    futures = [rpc.rpc_async("worker1", sleep_then, args=(30,)) for _ in range(3)]
    t0 = time.monotonic()
    errors = []
    for fut in futures:
        try:
            fut.wait()
        except RuntimeError as exc:
            errors.append(str(exc))
    elapsed = time.monotonic() - t0
    try:
        rpc.rpc_sync("worker1", sleep_then, args=(0,))
    except RuntimeError as exc:
        errors.append(str(exc))
    rpc.shutdown(graceful=False)
    return elapsed, errors


def test_a_dying_worker_fails_pending_futures_promptly():
    with pytest.raises(RanksFailed) as info:
        run_ranks(_dying_worker, 2, timeout=30)
    outcomes = info.value.outcomes
    assert "exited with code 3" in outcomes[1].summary  # the rank that died on purpose
    elapsed, errors = outcomes[0].result
    assert elapsed < 5.0
    assert len(errors) == 4 and all("worker1" in e for e in errors), errors


def _shutdown_after_a_worker_died(rank, world_size, timeout):
    start(rank, world_size)
    if rank == 1:
        os._exit(3)  # dies before it reaches the shutdown barrier
    time.sleep(1)
    t0 = time.monotonic()
    try:
        rpc.shutdown(timeout=timeout)  # graceful
    except RuntimeError as exc:
        return time.monotonic() - t0, str(exc), rpc.is_initialized()
    return time.monotonic() - t0, None, rpc.is_initialized()


@pytest.mark.parametrize("timeout", [0, 5], ids=["no-limit", "limit"])
def test_graceful_shutdown_raises_at_once_when_a_worker_died(timeout):
    with pytest.raises(RanksFailed) as info:
        run_ranks(_shutdown_after_a_worker_died, 2, args=(timeout,), timeout=30)
    elapsed, error, still_initialized = info.value.outcomes[0].result
    assert error is not None and "worker1 was lost before every worker reached the shutdown barrier" in error
    assert elapsed < 3 and not still_initialized


def _shutdown_while_a_worker_is_busy(rank, world_size):
    start(rank, world_size)
    if rank == 1:
        time.sleep(6)  # reaches the barrier after worker0's limit
        try:
            rpc.shutdown()
        except RuntimeError:
            pass  # worker0 gave up and left: the barrier is gone
        return None
    t0 = time.monotonic()
    try:
        rpc.shutdown(timeout=2)
    except RuntimeError as exc:
        return time.monotonic() - t0, str(exc)
    return time.monotonic() - t0, None


def test_graceful_shutdown_with_a_limit_gives_up_on_a_late_worker():
    (elapsed, error), _ = run_ranks(_shutdown_while_a_worker_is_busy, 2, timeout=30)
    assert error is not None and "not every worker reached the shutdown barrier within 2.00 seconds" in error
    assert 1.5 < elapsed < 4


def _uneven_work(rank, world_size):
    start(rank, world_size)
    # every worker leaves work in flight to every other one, of different lengths
    futures = [rpc.rpc_async(name(peer), sleep_then, args=(0.1 * (rank + 1), rank)) for peer in range(world_size)]
    t0 = time.monotonic()
    rpc.shutdown()  # graceful: waits for everything, everywhere
    return [f.done() for f in futures], [f.value() for f in futures], time.monotonic() - t0


def test_graceful_shutdown_waits_for_outstanding_calls_on_all_workers():
    results = run_ranks(_uneven_work, 3, timeout=30)
    for rank, (done, values, elapsed) in enumerate(results):
        assert all(done) and values == [rank] * 3
    assert results[0][2] >= 0.25  # worker 0 waited for worker 2's 0.3 s calls


def _with_secret(rank, world_size):
    start(rank, world_size)
    value = rpc.rpc_sync(name(1 - rank), torch.add, args=(1, 2))
    rpc.shutdown()
    return value


def test_authenticated_job_works_and_a_wrong_secret_is_refused():
    assert run_ranks(_with_secret, 2, env={"TORCHDIST_SECRET": "s3cret"}, timeout=30) == [3, 3]
    with pytest.raises(RanksFailed, match="failed to prove that it holds this job.s secret"):
        run_ranks(_secret_per_rank, 2, timeout=30)


def _secret_per_rank(rank, world_size):
    os.environ["TORCHDIST_SECRET"] = f"secret-of-rank-{rank}"
    try:
        start(rank, world_size)
    finally:
        os.environ.pop("TORCHDIST_SECRET")
