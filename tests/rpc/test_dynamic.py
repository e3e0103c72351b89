"""Dynamic membership (init_rpc with world_size=None): join late, leave early, refuse duplicates.

The expected messages and outcomes are torch.distributed.rpc's (TensorPipe agent)
for the same program, measured on torch 2.13.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch

import torchdist.rpc as rpc
from torchdist._store import TCPStore
from torchdist.rpc import api as rpc_api
from torchdist.testing import run_ranks


def _slow_add(a, b, delay):
    time.sleep(delay)
    return a + b


def _side_channel() -> TCPStore:
    """The store worker 0 hosts for RPC, used by the test to order the workers' steps."""
    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=timedelta(seconds=30))


def _join(name, rank):
    rpc.init_rpc(name, rank=rank, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(num_worker_threads=4))


def _infos():
    return [(w.name, w.id) for w in rpc_api._get_current_rpc_agent().get_worker_infos()]


def _refused(fn):
    try:
        fn()
    except (RuntimeError, ValueError) as exc:
        return str(exc)
    return "no error"


def _join_and_leave(rank, world_size):
    out = {}
    one = torch.ones(2)
    if rank == 0:
        _join("worker0", 0)
        out["alone"] = _infos()
        side = _side_channel()
        side.set("test/worker0_up", "1")
        side.wait(["test/worker1_up"])
        out["with_1"] = _infos()
        out["call_1"] = rpc.rpc_sync("worker1", torch.add, args=(one, 1))
        side.wait(["test/worker2_up"])
        out["call_2"] = rpc.rpc_sync(2, torch.add, args=(one, 2))
        out["info_2"] = rpc.get_worker_info("worker2")
        side.wait(["test/worker1_left"])
        out["after_leave"] = _infos()
        out["info_left"] = _refused(lambda: rpc.get_worker_info("worker1"))
        out["call_left_name"] = _refused(lambda: rpc.rpc_sync("worker1", torch.add, args=(one, 1)))
        out["call_left_rank"] = _refused(lambda: rpc.rpc_sync(1, torch.add, args=(one, 1)))
        side.set("test/worker0_checked", "1")
        side.wait(["test/worker1_rejoined"])
        out["rejoined"] = _infos()
        side.wait(["test/worker2_done"])
        rpc.shutdown()
    elif rank == 1:
        side = _side_channel()
        side.wait(["test/worker0_up"])
        _join("worker1", 1)
        out["infos"] = _infos()
        out["call_0"] = rpc.rpc_sync("worker0", torch.add, args=(one, 3))
        side.set("test/worker1_up", "1")
        side.wait(["test/worker2_up"])
        out["call_2"] = rpc.rpc_sync("worker2", torch.add, args=(one, 4))  # a worker that joined after this one
        pending = rpc.rpc_async("worker0", _slow_add, args=(one, 5, 0.3))
        rpc.shutdown()  # graceful: waits for this worker's call, not for the others
        out["pending_done"] = pending.done() and torch.equal(pending.value(), one + 5)
        side.set("test/worker1_left", "1")
        side.wait(["test/worker0_checked"])
        _join("worker1b", 1)  # the rank is free again
        out["rejoined_call"] = rpc.rpc_sync("worker0", torch.add, args=(one, 6))
        side.set("test/worker1_rejoined", "1")
        rpc.shutdown()
    else:
        side = _side_channel()
        side.wait(["test/worker1_up"])
        out["dup_name"] = _refused(lambda: _join("worker1", 2))
        out["dup_rank"] = _refused(lambda: _join("worker2", 0))
        out["static_in_dynamic"] = _refused(lambda: rpc.init_rpc("worker2", rank=2, world_size=3))
        out["initialized_after_refusals"] = rpc.is_initialized()
        _join("worker2", 2)
        out["infos"] = _infos()
        out["call_1"] = rpc.rpc_sync("worker1", torch.add, args=(one, 7))
        side.set("test/worker2_up", "1")
        side.wait(["test/worker1_rejoined"])
        side.set("test/worker2_done", "1")
        rpc.shutdown()
    return out


def test_workers_join_late_and_leave_early():
    r0, r1, r2 = run_ranks(_join_and_leave, 3, timeout=40)
    one = torch.ones(2)
    assert r0["alone"] == [("worker0", 0)]
    assert r0["with_1"] == [("worker0", 0), ("worker1", 1)]
    assert torch.equal(r0["call_1"], one + 1) and torch.equal(r0["call_2"], one + 2)
    assert r0["info_2"] == rpc.WorkerInfo("worker2", 2)
    assert r0["after_leave"] == [("worker0", 0), ("worker2", 2)]
    assert r0["info_left"] == "name:worker0,rank:0 could not find destination name worker1"
    assert r0["call_left_name"] == "name:worker0,rank:0 could not find destination name worker1"
    assert r0["call_left_rank"] == "name:worker0,rank:0 could not find destination id 1"
    assert r0["rejoined"] == [("worker0", 0), ("worker1b", 1), ("worker2", 2)]
    assert r1["infos"] == [("worker0", 0), ("worker1", 1)]
    assert torch.equal(r1["call_0"], one + 3) and torch.equal(r1["call_2"], one + 4)
    assert r1["pending_done"]
    assert torch.equal(r1["rejoined_call"], one + 6)
    assert r2["dup_name"] == "RPC worker name worker1 is not unique. Workers 2 and 1 share the same name."
    assert r2["dup_rank"] == ("RPC worker id 0 is not unique. Worker worker0 already has ID 0 and worker2 cannot be "
                              "added.")
    assert r2["static_in_dynamic"].startswith("RPC group mixes statically and dynamically initialized members")
    assert r2["initialized_after_refusals"] is False
    assert r2["infos"] == [("worker0", 0), ("worker1", 1), ("worker2", 2)]
    assert torch.equal(r2["call_1"], one + 7)


def test_dynamic_init_needs_a_rank():
    with pytest.raises(ValueError, match="needs this worker's rank"):
        rpc.init_rpc("worker0", rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method="tcp://127.0.0.1:1"))
