"""The RPC backend registry: registering backends, their handlers, and init_rpc through a registered backend.

Registrations are process-wide, as in PyTorch: the tests in this process use
fresh names; the world-2 run registers its backends in the spawned ranks.
"""

from __future__ import annotations

import logging
import uuid

import pytest
import torch.distributed.rpc as trpc
import torch.distributed.rpc.backend_registry as tregistry

import torchdist
import torchdist.rpc as rpc
import torchdist.rpc.backend_registry as registry
from torchdist.rpc.constants import DEFAULT_INIT_METHOD, DEFAULT_RPC_TIMEOUT_SEC
from torchdist.testing import free_port, run_ranks


def _fresh_name() -> str:
    return f"TEST_{uuid.uuid4().hex[:8].upper()}"


def _outcome(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the error is the observation
        return type(exc).__name__, str(exc)
    return "ok", None


def test_names_match_torch():
    assert registry.__all__ == tregistry.__all__
    for name in tregistry.__all__:
        assert name in rpc.__all__ and hasattr(rpc, name), name
    assert rpc.BackendType is registry.BackendType
    assert rpc.backend_registry is registry


def test_register_adds_a_member():
    name = _fresh_name()

    def options_handler(rpc_timeout, init_method, **kwargs):
        return ("options", rpc_timeout, init_method, kwargs)

    def init_handler(*args, **kwargs):
        return ("agent", args, kwargs)

    assert not rpc.backend_registered(name)
    member = rpc.register_backend(name, options_handler, init_handler)
    assert rpc.backend_registered(name)
    assert member is rpc.BackendType[name] is getattr(rpc.BackendType, name)
    assert isinstance(member, rpc.BackendType) and isinstance(rpc.BackendType.TENSORPIPE, rpc.BackendType)
    assert repr(member) == f"BackendType.{name}" and member.name == name
    assert member.value == rpc.BackendValue(options_handler, init_handler)
    assert member.value.construct_rpc_backend_options_handler is options_handler
    assert list(rpc.BackendType)[0] is member and rpc.BackendType.TENSORPIPE in list(rpc.BackendType)
    assert rpc.BackendType(member.value) is member
    # the handlers, called with PyTorch's arguments
    assert rpc.construct_rpc_backend_options(member) == ("options", DEFAULT_RPC_TIMEOUT_SEC, DEFAULT_INIT_METHOD, {})
    assert rpc.construct_rpc_backend_options(member, rpc_timeout=3, init_method="tcp://h:1", extra=1) == \
        ("options", 3, "tcp://h:1", {"extra": 1})
    assert rpc.init_backend(member, 1, store="s", name="n") == ("agent", (1,), {"store": "s", "name": "n"})


def test_errors_match_torch():
    name = _fresh_name()
    for reg in (registry, tregistry):  # (init_rpc's backend inference makes every backend's options)
        reg.register_backend(name, lambda rpc_timeout, init_method, **kwargs: None, None)
    cases = [
        lambda reg: reg.register_backend(name, None, None),
        lambda reg: reg.register_backend("TENSORPIPE", None, None),
        lambda reg: reg.construct_rpc_backend_options("TENSORPIPE"),
        lambda reg: reg.init_backend(reg.BackendType.TENSORPIPE, store=None, name="w", rank=0, world_size=1,
                                     rpc_backend_options=reg.construct_rpc_backend_options(
                                         reg.BackendType.TENSORPIPE)),
        lambda reg: reg.init_backend(reg.BackendType.TENSORPIPE, store=_store(reg), name="w", rank=0,
                                     world_size=1, rpc_backend_options="options"),
    ]
    for i, case in enumerate(cases):
        mine, theirs = _outcome(case, registry), _outcome(case, tregistry)
        assert mine[0] == theirs[0], (i, mine, theirs)
        if i != 4:  # (the options' repr differs)
            assert mine == theirs, (i, mine, theirs)


def _store(reg):
    if reg is registry:
        return torchdist.HashStore()
    import torch.distributed as tdist
    return tdist.HashStore()


def test_init_rpc_argument_errors_match_torch():
    cases = [dict(backend="TENSORPIPE"), dict(rpc_backend_options=object()),
             dict(rpc_backend_options="TensorPipe")]
    for kwargs in cases:
        assert _outcome(rpc.init_rpc, "w", **kwargs) == _outcome(trpc.init_rpc, "w", **kwargs), kwargs
    mine = _outcome(rpc.init_rpc, "w", rpc_backend_options=rpc.RpcBackendOptions())
    theirs = _outcome(trpc.init_rpc, "w", rpc_backend_options=trpc.RpcBackendOptions())
    assert mine[0] == theirs[0] == "TypeError"
    assert mine[1].startswith("Could not infer backend for options") and theirs[1].startswith(mine[1][:36])
    assert not rpc.is_initialized()


def test_construct_tensorpipe_options_like_torch():
    kwargs = dict(rpc_timeout=7, init_method="tcp://127.0.0.1:29999", num_worker_threads=3, _transports=["uv"])
    mine = rpc.construct_rpc_backend_options(rpc.BackendType.TENSORPIPE, **kwargs)
    theirs = tregistry.construct_rpc_backend_options(tregistry.BackendType.TENSORPIPE, **kwargs)
    assert type(mine) is rpc.TensorPipeRpcBackendOptions
    for attr in ("rpc_timeout", "init_method", "num_worker_threads"):
        assert getattr(mine, attr) == getattr(theirs, attr), attr
    assert mine._transports == ["uv"]
    default = rpc.construct_rpc_backend_options(rpc.BackendType.TENSORPIPE)
    assert (default.rpc_timeout, default.init_method) == (DEFAULT_RPC_TIMEOUT_SEC, DEFAULT_INIT_METHOD)


def test_handler_that_starts_no_agent_is_an_error():
    member = rpc.register_backend(_fresh_name(), registry._tensorpipe_construct_rpc_backend_options_handler,
                                  lambda **kwargs: "not an agent")
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{free_port()}", rpc_timeout=10)
    with pytest.raises(RuntimeError, match="without starting torchdist's agent"):
        rpc.init_rpc("w", backend=member, rank=0, world_size=1, rpc_backend_options=options)
    assert not rpc.is_initialized()


# -- a registered backend wrapping the built-in one, at world size 2 ---------------------------------------------


class _CountingAgent:
    """An agent wrapping torchdist's: counts the calls sent through it, delegates the rest."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls = 0

    def call(self, *args, **kwargs):
        self.calls += 1
        return self.inner.call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _WrappedOptions(rpc.TensorPipeRpcBackendOptions):
    """The custom backend's options type (so that init_rpc can infer the backend from the options)."""


_seen: dict = {}


def _wrapped_options_handler(rpc_timeout, init_method, **kwargs):
    _seen.setdefault("options_calls", []).append((rpc_timeout, init_method, kwargs))
    return _WrappedOptions(rpc_timeout=rpc_timeout, init_method=init_method, **kwargs)


def _wrapped_init_handler(*args, **kwargs):
    _seen.setdefault("init_calls", []).append((args, sorted(kwargs), type(kwargs["store"]).__name__,
                                               kwargs["name"], kwargs["rank"], kwargs["world_size"],
                                               type(kwargs["rpc_backend_options"]).__name__))
    agent = rpc.init_backend(rpc.BackendType.TENSORPIPE, *args, **kwargs)
    _seen["agent"] = _CountingAgent(agent)
    return _seen["agent"]


def _add(a, b):
    return a + b


def _custom_backend(rank: int, world_size: int, port: int):
    member = rpc.register_backend("WRAPPED", _wrapped_options_handler, _wrapped_init_handler)
    peer = f"worker{1 - rank}"
    out = {}
    # backend given, options made by its handler (env:// from run_ranks)
    rpc.init_rpc(f"worker{rank}", backend=member, rank=rank, world_size=world_size)
    out["agent_is_wrapper"] = rpc.api._get_current_rpc_agent() is _seen["agent"]
    out["sum"] = rpc.rpc_sync(peer, _add, args=(rank, 10))
    out["remote"] = rpc.remote(peer, _add, args=(1, 2)).to_here()
    out["info"] = repr(rpc.get_worker_info(peer))
    rpc.shutdown()
    out["calls"] = _seen["agent"].calls
    # backend inferred from the options' type, on a new rendezvous (at a port the test chose)
    options = _WrappedOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=30)
    logging.getLogger("torchdist.rpc.backend_registry").setLevel(logging.ERROR)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    out["inferred_sum"] = rpc.rpc_sync(peer, _add, args=(rank, 20))
    rpc.shutdown()
    out["options_calls"] = _seen["options_calls"]
    out["init_calls"] = _seen["init_calls"]
    return out


def test_custom_backend_wrapping_the_builtin_one():
    results = run_ranks(_custom_backend, 2, args=(free_port(),), timeout=60)
    for rank, out in enumerate(results):
        assert out["agent_is_wrapper"]
        assert out["sum"] == rank + 10 and out["remote"] == 3 and out["inferred_sum"] == rank + 20
        assert out["info"] == f"WorkerInfo(id={1 - rank}, name=worker{1 - rank})"
        assert out["calls"] >= 2  # the rpc_sync and the remote went through the wrapper
        # options made once, by init_rpc with PyTorch's defaults (the inference loop makes more, as PyTorch's)
        assert out["options_calls"][0] == (DEFAULT_RPC_TIMEOUT_SEC, DEFAULT_INIT_METHOD, {})
        expected_kwargs = ["name", "rank", "rpc_backend_options", "store", "world_size"]
        assert [call[:2] for call in out["init_calls"]] == [((), expected_kwargs)] * 2
        for call in out["init_calls"]:
            assert call[3:] == (f"worker{rank}", rank, 2, "_WrappedOptions")
            assert call[2].endswith("Store"), call


def test_backend_inferred_from_the_options_type():
    class Options(rpc.TensorPipeRpcBackendOptions):
        pass

    member = rpc.register_backend(_fresh_name(), lambda rpc_timeout, init_method, **kwargs: Options(), None)
    assert registry.resolve_backend(None, Options())[0] is member
    assert registry.resolve_backend(None, rpc.TensorPipeRpcBackendOptions())[0] is rpc.BackendType.TENSORPIPE
    backend, options = registry.resolve_backend(member, None)
    assert backend is member and type(options) is Options
