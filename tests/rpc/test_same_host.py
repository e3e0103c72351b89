"""The same-host fast path: Unix sockets, large tensors through memfd segments, and their release."""

from __future__ import annotations

import gc
import os
import socket
import time

import pytest
import torch

import torchdist.rpc as rpc
from torchdist.rpc import api, same_host
from torchdist.testing import RanksFailed, run_ranks

from ._common import start

BIG = 1 << 20  # float32 elements: 4 MiB, above same_host.SEGMENT_MIN_BYTES

pytestmark = pytest.mark.skipif(not same_host.available(), reason="memfd and SCM_RIGHTS are Linux only")


def _segments_held() -> tuple[int, int]:
    """(descriptors, mappings) of this process that are RPC segments."""
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += "memfd:torchdist-rpc" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        maps = sum("memfd:torchdist-rpc" in line for line in f)
    return fds, maps


def _shm_files() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def keep_and_sum(x, store={}):  # noqa: B006 - the callee keeps the last tensor it received
    store["last"] = x
    return float(x.sum()), _segments_held()


def drop_kept(store=keep_and_sum.__defaults__[0]):
    store.clear()
    gc.collect()
    return _segments_held()


def scaled(x, factor):
    return x * factor


def _connection_families() -> set[int]:
    return {conn.sock.family for conn in api._get().agent._conns.values()}


def _large_tensors(rank, world_size, transports):
    before = _shm_files()
    start(rank, world_size, _transports=transports)
    made = []
    real = same_host.make_segment

    def counting(buf):
        made.append(buf.nbytes)
        return real(buf)
    same_host.make_segment = counting
    result = None
    if rank == 0:
        x = torch.arange(BIG, dtype=torch.float32)
        total, held_remote = rpc.rpc_sync("worker1", keep_and_sum, args=(x,))
        y = rpc.rpc_sync("worker1", scaled, args=(x, 2.0))  # a large answer travels the same way
        equal = torch.equal(y, x * 2)
        del y
        gc.collect()
        released_remote = rpc.rpc_sync("worker1", drop_kept)
        result = (total, held_remote, released_remote, equal, _segments_held())
    families = _connection_families()
    rpc.shutdown()
    same_host.make_segment = real
    return result, families, made, _shm_files() - before


def test_large_tensors_take_the_segment_path_and_leave_nothing_behind():
    results = run_ranks(_large_tensors, 2, args=(None,), timeout=60)
    (total, held_remote, released_remote, equal, held_here), families, made, new_files = results[0]
    assert total == float(torch.arange(BIG, dtype=torch.float32).sum())
    assert equal
    assert families == {socket.AF_UNIX}
    assert made == [BIG * 4] * 2  # worker0 sent its two arguments in segments
    assert results[1][2] == [BIG * 4]  # worker1 answered with one
    assert held_remote == (0, 1)  # the callee maps the argument; no descriptor stays open
    assert released_remote == (0, 0)  # unmapped once the tensor is gone
    assert held_here == (0, 0)  # the answer's mapping went with ``y``
    assert new_files == set()  # segments are anonymous: nothing under /dev/shm


def test_tcp_only_transports_keep_tcp_and_still_move_large_tensors():
    results = run_ranks(_large_tensors, 2, args=(["uv"],), timeout=60)
    (total, held_remote, released_remote, equal, _), families, made, _ = results[0]
    assert total == float(torch.arange(BIG, dtype=torch.float32).sum()) and equal
    assert families == {socket.AF_INET}
    assert made == [] and held_remote == (0, 0)


def hold(x, store={}):  # noqa: B006
    store["x"] = x
    return _segments_held()


def _dies_holding_segments(rank, world_size):
    start(rank, world_size)
    if rank == 1:
        time.sleep(30)  # killed by worker0's request below
        return None
    x = torch.ones(BIG)
    held_remote = rpc.rpc_sync("worker1", hold, args=(x,))
    pending = [rpc.rpc_async("worker1", os._exit, args=(3,)), rpc.rpc_async("worker1", scaled, args=(x, 1.0))]
    errors = []
    for fut in pending:
        try:
            fut.wait()
        except RuntimeError as exc:
            errors.append(str(exc))
    gc.collect()
    held_here = _segments_held()
    rpc.shutdown(graceful=False)
    return held_remote, errors, held_here


def test_a_killed_worker_leaves_no_segments():
    before = _shm_files()
    with pytest.raises(RanksFailed) as info:
        run_ranks(_dies_holding_segments, 2, timeout=30)
    outcomes = info.value.outcomes
    assert "exited with code 3" in outcomes[1].summary
    held_remote, errors, held_here = outcomes[0].result
    assert held_remote == (0, 1)  # the dead worker held a mapping, freed by the kernel with it
    assert errors and all("worker1" in e for e in errors), errors
    assert held_here == (0, 0)  # nothing of the calls in flight stays open on the survivor
    assert _shm_files() - before == set()
