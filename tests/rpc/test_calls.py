"""rpc_sync / rpc_async / remote with builtins and user functions, destinations, worker infos."""

from __future__ import annotations

import pickle

import pytest
import torch

import torchdist.rpc as rpc
from torchdist.testing import RanksFailed, run_ranks

from ._common import name, start


def add_scaled(a, b, *, scale=1):
    return (a + b) * scale


class Counter:
    def __init__(self, start=0):
        self.value = start

    def increment(self, by=1):
        self.value += by
        return self.value

    def get(self):
        return self.value


def _every_call_kind(rank, world_size):
    start(rank, world_size)
    peer = (rank + 1) % world_size
    ones = torch.ones(3)
    results = {}
    # builtins (torch ops) and user functions, by name, WorkerInfo and rank, and to self
    results["builtin_sync"] = rpc.rpc_sync(name(peer), torch.add, args=(ones, 2))
    results["builtin_async"] = rpc.rpc_async(rpc.get_worker_info(name(peer)), torch.mul, args=(ones, 3)).wait()
    results["builtin_remote"] = rpc.remote(peer, torch.sub, args=(ones, 1)).to_here()
    results["user_sync"] = rpc.rpc_sync(peer, add_scaled, args=(ones, ones), kwargs={"scale": 2})
    fut = rpc.rpc_async(name(peer), add_scaled, args=(1, 2), kwargs={"scale": 10})
    results["future_type"] = type(fut).__name__
    results["user_async"] = fut.wait()
    results["user_remote"] = rpc.remote(name(peer), add_scaled, args=(ones, 1)).to_here()
    results["self_sync"] = rpc.rpc_sync(name(rank), add_scaled, args=(1, 1))
    self_rref = rpc.remote(name(rank), add_scaled, args=(2, 2))
    results["self_remote"] = (self_rref.is_owner(), self_rref.to_here(), self_rref.local_value())
    # classes by reference: a remote object and its methods through the RRef proxies
    counter = rpc.remote(name(peer), Counter, args=(5,))
    counter.rpc_sync().increment(2)
    counter.rpc_async().increment().wait()
    results["proxy"] = (counter.rpc_sync().get(), counter.remote().get().to_here())
    # arguments are copies, also to self
    t = torch.zeros(2)
    rpc.rpc_sync(name(rank), torch.Tensor.add_, args=(t, 1))
    results["copied"] = t
    # many tensors, views, odd dtypes and shapes
    big = torch.arange(100, dtype=torch.float64)
    odd = {"view": big[10:20:2], "bf16": torch.ones(3, dtype=torch.bfloat16), "bool": torch.tensor([True, False]),
           "scalar": torch.tensor(7), "empty": torch.empty(0, 4), "complex": torch.tensor([1 + 2j])}
    back = rpc.rpc_sync(peer, _identity, args=(odd,))
    results["roundtrip"] = all(torch.equal(back[k], odd[k]) and back[k].dtype == odd[k].dtype for k in odd)
    results["info"] = (rpc.get_worker_info(), rpc.get_worker_info(name(peer)))
    results["info_through_rpc"] = rpc.rpc_sync(peer, _identity, args=(rpc.get_worker_info(),))
    rpc.shutdown()
    return results


def _identity(x):
    return x


def test_every_call_kind_with_builtins_and_user_functions():
    results = run_ranks(_every_call_kind, 2, timeout=30)
    for rank, res in enumerate(results):
        assert torch.equal(res["builtin_sync"], torch.full((3,), 3.0))
        assert torch.equal(res["builtin_async"], torch.full((3,), 3.0))
        assert torch.equal(res["builtin_remote"], torch.zeros(3))
        assert torch.equal(res["user_sync"], torch.full((3,), 4.0))
        assert res["future_type"] == "Future" and res["user_async"] == 30
        assert torch.equal(res["user_remote"], torch.full((3,), 2.0))
        assert res["self_sync"] == 2 and res["self_remote"] == (True, 4, 4)
        assert res["proxy"] == (8, 8)
        assert torch.equal(res["copied"], torch.zeros(2))
        assert res["roundtrip"]
        me, peer = res["info"]
        assert (me.name, me.id) == (name(rank), rank) and (peer.name, peer.id) == (name(1 - rank), 1 - rank)
        assert res["info_through_rpc"] == me and repr(me) == f"WorkerInfo(id={rank}, name=worker{rank})"


def _bad_destinations(rank, world_size):
    start(rank, world_size)
    errors = []
    for call in (lambda: rpc.get_worker_info("nobody"), lambda: rpc.rpc_sync("nobody", add_scaled, args=(1, 1)),
                 lambda: rpc.rpc_sync(5, add_scaled, args=(1, 1))):
        try:
            call()
        except RuntimeError as exc:
            errors.append(str(exc))
    for call, kind in ((lambda: rpc.rpc_sync(1.5, add_scaled, args=(1, 1)), ValueError),
                       (lambda: rpc.rpc_sync("worker1", 3), TypeError),
                       (lambda: rpc.remote("worker1", "not a function"), TypeError)):
        try:
            call()
        except kind as exc:  # PyTorch's types, raised here, before anything is sent
            errors.append(str(exc))
    rpc.shutdown()
    return errors


def test_unknown_destination_raises_could_not_find_destination():
    errors = run_ranks(_bad_destinations, 2, timeout=30)[0]
    assert errors[:3] == ["name:worker0,rank:0 could not find destination name nobody"] * 2 + [
        "name:worker0,rank:0 could not find destination id 5"]
    assert errors[3].startswith("Cannot get WorkerInfo from name 1.5")
    assert errors[4:] == ["function should be callable."] * 2


def test_worker_names_and_options_are_validated():
    for bad, fragment in (("a b", "Worker name must match"), ("", "must be non-empty"),
                          ("a" * 130, "shorter than 128")):
        with pytest.raises(RuntimeError, match=fragment):
            rpc.init_rpc(bad, rank=0, world_size=1)
    with pytest.raises(TypeError):
        rpc.init_rpc("w", rank=0, world_size=1, rpc_backend_options=object())
    with pytest.raises(ValueError, match="1-to-1"):
        rpc.TensorPipeRpcBackendOptions(device_maps={"w1": {"cpu": "cpu", "meta": "cpu"}})
    with pytest.raises(RuntimeError, match="RPC Timeout must be non-negative"):  # PyTorch's type and words
        rpc.TensorPipeRpcBackendOptions(rpc_timeout=-5)


def _same_name(rank, world_size):
    rpc.init_rpc("twin", rank=rank, world_size=world_size)


def test_duplicate_worker_name_is_not_unique():
    with pytest.raises(RanksFailed, match="is not unique"):
        run_ranks(_same_name, 2, timeout=30)


def _after_shutdown(rank, world_size):
    start(rank, world_size)
    timeout = rpc.get_rpc_timeout()
    rpc.shutdown()
    try:
        rpc.rpc_sync(name(1 - rank), add_scaled, args=(1, 1))
    except RuntimeError as exc:
        return timeout, str(exc)


def test_calls_after_shutdown_raise_not_initialized():
    for timeout, message in run_ranks(_after_shutdown, 2, timeout=30):
        assert timeout == 60.0
        assert message.startswith("RPC has not been initialized")


def test_rref_cannot_be_pickled_outside_rpc():
    rpc.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{_port()}"))
    try:
        rref = rpc.RRef(torch.ones(2))
        assert rref.is_owner() and rref.owner_name() == "solo" and rref.confirmed_by_owner()
        with pytest.raises(RuntimeError, match="rref can only be pickled when using RPC"):
            pickle.dumps(rref)
        with pytest.raises(RuntimeError, match="already initialized"):
            rpc.init_rpc("solo", rank=0, world_size=1)
    finally:
        rpc.shutdown()


def _port():
    from torchdist.testing import free_port

    return free_port()


def _many_concurrent(rank, world_size):
    start(rank, world_size, num_worker_threads=4)
    peer = name(1 - rank)
    futures = [rpc.rpc_async(peer, add_scaled, args=(torch.full((4,), float(i)), 1)) for i in range(1000)]
    values = torch.futures.wait_all(futures)
    ok = all(torch.equal(v, torch.full((4,), float(i + 1))) for i, v in enumerate(values))
    rpc.shutdown()
    return ok


def test_1000_concurrent_rpc_async_calls_complete():
    assert run_ranks(_many_concurrent, 2, timeout=60) == [True, True]


def _large_tensors(rank, world_size):
    start(rank, world_size)
    big = torch.randn(4 << 20)  # 16 MiB
    back = rpc.rpc_sync(name(1 - rank), _identity, args=(big,))
    rpc.shutdown()
    return torch.equal(back, big)


def test_large_tensor_arguments_round_trip():
    assert run_ranks(_large_tensors, 2, timeout=30) == [True, True]
