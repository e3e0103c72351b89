"""RRefs: owner and user API, proxies, forwarding, and the reference-counting protocol."""

from __future__ import annotations

import gc
import time
import weakref

import torch

import torchdist.rpc as rpc
from torchdist.rpc import rref_context
from torchdist.testing import run_ranks

from ._common import name, start

_LIVE: "weakref.WeakSet[Tracked]" = weakref.WeakSet()
_HELD: list = []


class Tracked:
    """A value whose live instances the owner can count."""

    def __init__(self, value):
        self.value = value
        _LIVE.add(self)

    def get(self):
        return self.value


def _live_count():
    gc.collect()
    return len(_LIVE), len(rref_context.current().owners)


def _hold(rref):
    _HELD.append(rref)
    return rref.is_owner(), rref.owner_name(), rref.rpc_sync().get()


def _drop():
    _HELD.clear()
    gc.collect()


def _three_worker_chain(rank, world_size):
    start(rank, world_size)
    out = {}
    if rank == 1:
        rref = rpc.remote("worker0", Tracked, args=(42,))
        out["user"] = (rref.is_owner(), rref.owner(), rref.owner_name(), rref.rpc_sync().get())
        out["confirmed"] = rref.confirmed_by_owner()
        out["forked"] = rpc.rpc_sync("worker2", _hold, args=(rref,))  # user -> third worker: a fork
        del rref
        gc.collect()
        time.sleep(0.3)  # the deletion of worker1's fork reaches the owner
        out["after_first_user"] = rpc.rpc_sync("worker0", _live_count)
        rpc.rpc_sync("worker2", _drop)  # the last reference goes
        deadline = time.monotonic() + 5
        while rpc.rpc_sync("worker0", _live_count) != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.02)
        out["after_last_user"] = rpc.rpc_sync("worker0", _live_count)
    rpc.shutdown()
    return out


def test_three_worker_chain_deletes_the_value_when_the_last_fork_goes():
    out = run_ranks(_three_worker_chain, 3, timeout=30)[1]
    assert out["user"] == (False, rpc.WorkerInfo("worker0", 0), "worker0", 42)
    assert out["confirmed"]
    assert out["forked"] == (False, "worker0", 42)
    assert out["after_first_user"] == (1, 1)  # worker2's fork keeps it
    assert out["after_last_user"] == (0, 0)


def _owner_and_user_api(rank, world_size):
    start(rank, world_size)
    out = {}
    if rank == 0:
        rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
        try:
            rref.local_value()
        except RuntimeError as exc:
            out["local_value"] = str(exc)
        # an RRef sent back to its owner is the owner's RRef there
        out["at_owner"] = rpc.rpc_sync("worker1", _is_owner_and_value, args=(rref,))
        # nested in containers, and forwarded user -> owner -> user
        out["nested"] = rpc.rpc_sync("worker1", _sum_nested, args=({"a": [rref, rref]},))
        local = rpc.RRef(torch.full((2,), 3.0))
        out["local"] = (local.is_owner(), local.owner_name(), local.local_value(), local.to_here())
        out["owner_sends_own"] = rpc.rpc_sync("worker1", _fetch, args=(local,))
        out["remote_proxy"] = rpc.remote("worker1", Tracked, args=(5,)).remote().get().to_here()
        out["type"] = rref._get_type()
        keep = rref
    rpc.shutdown()
    if rank == 0:
        try:
            keep.to_here()
        except RuntimeError as exc:
            out["after_shutdown"] = str(exc)
    return out


def _is_owner_and_value(rref):
    return rref.is_owner(), rref.local_value()


def _sum_nested(tree):
    return sum(r.to_here() for r in tree["a"])


def _fetch(rref):
    return rref.is_owner(), rref.to_here()


def test_owner_and_user_api():
    out = run_ranks(_owner_and_user_api, 2, timeout=30)[0]
    assert "can't call localValue() on user WorkerInfo(id=0, name=worker0)" in out["local_value"]
    assert "Call it on owner WorkerInfo(id=1, name=worker1)" in out["local_value"]
    is_owner, value = out["at_owner"]
    assert is_owner and torch.equal(value, torch.full((2,), 2.0))
    assert torch.equal(out["nested"], torch.full((2,), 4.0))
    assert out["local"][:2] == (True, "worker0") and torch.equal(out["local"][2], torch.full((2,), 3.0))
    assert out["owner_sends_own"][0] is False and torch.equal(out["owner_sends_own"][1], torch.full((2,), 3.0))
    assert out["remote_proxy"] == 5
    assert out["type"] is torch.Tensor
    assert out["after_shutdown"].endswith("has been deleted. Cannot call to_here() on it after deletion.")


def _forks_released_at_shutdown(rank, world_size):
    start(rank, world_size)
    if rank == 1:
        _HELD.extend(rpc.remote("worker0", Tracked, args=(i,)) for i in range(5))
        [r.to_here() for r in _HELD]
    owners = None
    if rank == 0:
        time.sleep(0.3)
        owners = len(rref_context.current().owners)
    rpc.shutdown()  # worker1 never deleted its RRefs: shutdown does
    gc.collect()
    return owners, len(_LIVE) if rank == 0 else None


def test_shutdown_deletes_user_rrefs_and_owner_values():
    (owners, live), _ = run_ranks(_forks_released_at_shutdown, 2, timeout=30)
    assert owners == 5
    assert live == 0


def _plus_five(a):
    return a + 5


class Box:
    """A value with a plain and an ``@async_execution`` method, for the proxies."""

    def __init__(self):
        self.count = 0

    def increment(self):
        self.count += 1
        return self.count

    @rpc.functions.async_execution
    def plus_five_on(self, to, a):
        return rpc.rpc_async(to, _plus_five, args=(a,))


_BOX = Box()


def _the_box():
    return _BOX


def _remote_to_self_and_async_proxies(rank, world_size):
    start(rank, world_size)
    out = {}
    if rank == 0:
        mine = rpc.remote(name(0), _the_box)  # the result itself is the value, as in PyTorch: not a copy
        mine.rpc_sync().increment()
        out["self"] = (mine.local_value() is _BOX, _BOX.count)
        theirs = rpc.remote(name(1), Box)
        out["async_proxies"] = (theirs.remote().plus_five_on(name(0), 1).to_here(),
                                mine.remote().plus_five_on(name(1), 2).to_here(),
                                theirs.rpc_sync().plus_five_on(name(0), 3), theirs.remote().increment().to_here())
        try:  # a remote() that cannot be sent leaves no fork for shutdown to wait on
            rpc.remote(name(1), lambda: 5)
        except Exception as exc:  # noqa: BLE001
            out["unsendable"] = type(exc).__name__
        del mine, theirs
        gc.collect()
    began = time.monotonic()
    rpc.shutdown()
    out["shutdown_s"] = time.monotonic() - began
    return out


def test_remote_to_self_keeps_the_result_and_async_methods_work_through_every_proxy():
    out = run_ranks(_remote_to_self_and_async_proxies, 2, timeout=40)
    assert out[0]["self"] == (True, 1)
    assert out[0]["async_proxies"] == (6, 7, 8, 1)
    assert out[0]["unsendable"] in ("AttributeError", "PicklingError")
    assert all(res["shutdown_s"] < 10 for res in out), [res["shutdown_s"] for res in out]
