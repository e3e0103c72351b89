"""RemoteModule against the same modules run in one process, and against torch.distributed's RemoteModule."""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch
from torch import nn

import torchdist.autograd as dist_autograd
import torchdist.rpc as rpc
from torchdist.nn import RemoteModule
from torchdist.nn.api.remote_module import _parse_remote_device
from torchdist.optim import DistributedOptimizer
from torchdist.testing import run_ranks

from ._common import name, start


def _seeded(module: nn.Module, seed: int) -> nn.Module:
    """``module`` with parameters drawn from its own generator: workers build modules concurrently, in threads
    that would race on the global RNG."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.rand(param.shape, generator=generator) - 0.5)
    return module


class Net(nn.Module):
    """A submodule, a direct parameter, a buffer, and a forward with positional and keyword arguments."""

    def __init__(self, seed: int, n_in: int = 4, n_out: int = 3) -> None:
        super().__init__()
        self.lin = nn.Linear(n_in, n_out)
        self.scale = nn.Parameter(torch.empty(n_out))
        self.register_buffer("offset", torch.full((n_out,), 0.25))
        _seeded(self, seed)

    def forward(self, x, shift=0.0, *, power=1):
        return (torch.tanh(self.lin(x)) * self.scale + self.offset) ** power + shift


class NotAModule:
    pass


def _inputs(seed: int = 100) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))


def _forward_everywhere(rank, world_size):
    """Every worker drives RemoteModules on every other worker, through each remote_device format."""
    start(rank, world_size)
    x = _inputs()
    out = {}
    for peer in range(world_size):
        if peer == rank:
            continue
        for device in (f"{name(peer)}/cpu", f"rank:{peer}/cpu", name(peer)):
            rm = RemoteModule(device, Net, args=(peer,), kwargs={"n_out": 3})
            future = rm.forward_async(x, 1.5, power=2)
            out[peer, device] = {
                "forward": rm.forward(x),
                "args_kwargs": future.wait(),
                "future_type": isinstance(future, torch._C.Future),  # torch.Future, as rpc_async returns
                "call": rm(x, shift=-1.0),
                "in_module": nn.Sequential(rm, nn.Identity())(x),
                "on_device": (rm.on, rm.device, rm.is_device_map_set, rm.is_scriptable),
                "params": [p.to_here() for p in rm.remote_parameters()],
                "direct_params": [p.to_here() for p in rm.remote_parameters(recurse=False)],
                "module": rm.get_module_rref().to_here(),
            }
    rpc.shutdown()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_forward_and_forward_async_equal_the_module_run_locally(world_size):
    results = run_ranks(_forward_everywhere, world_size, timeout=60)
    x = _inputs()
    for rank, out in enumerate(results):
        assert len(out) == 3 * (world_size - 1)
        for (peer, device), got in out.items():
            local = Net(peer)
            assert torch.equal(got["forward"], local(x)), (rank, device)
            assert torch.equal(got["args_kwargs"], local(x, 1.5, power=2)), (rank, device)
            assert got["future_type"]
            assert torch.equal(got["call"], local(x, shift=-1.0))
            assert torch.equal(got["in_module"], local(x))
            on = peer if device.startswith("rank:") else name(peer)
            assert got["on_device"] == (on, "cpu", False, False)
            assert [tuple(p.shape) for p in got["params"]] == [(3,), (3, 4), (3,)]  # torch's order: own first
            assert all(torch.equal(a, b) for a, b in zip(got["params"], local.parameters()))
            assert len(got["direct_params"]) == 1 and torch.equal(got["direct_params"][0], local.scale)
            assert isinstance(got["module"], Net) and torch.equal(got["module"].offset, local.offset)


# -- training: the "Combining DDP with Distributed RPC" pattern, without DDP -------------------
class _Hybrid(nn.Module):
    """A remote EmbeddingBag, a local Linear and (with a third worker) a remote Linear after it."""

    def __init__(self, emb: nn.Module, local: nn.Linear, head: nn.Module | None) -> None:
        super().__init__()
        self.emb, self.local, self.head = emb, local, head

    def forward(self, indices, offsets):
        h = self.local(self.emb.forward(indices, offsets))
        return self.head(torch.relu(h)) if self.head is not None else h


def _embedding(seed):
    return _seeded(nn.EmbeddingBag(20, 6, mode="sum"), seed)


def _linear(seed, n_in, n_out):
    return _seeded(nn.Linear(n_in, n_out), seed)


def _batches(steps=4):
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, 20, (12,), generator=g), torch.tensor([0, 3, 5, 9]),
             torch.randint(0, 2, (4,), generator=g)) for _ in range(steps)]


def _train_remote(rank, world_size):
    start(rank, world_size)
    out = None
    if rank == 0:
        emb = RemoteModule(f"{name(1)}/cpu", _embedding, args=(1,))
        head = RemoteModule("rank:2/cpu", _linear, args=(2, 5, 2)) if world_size == 3 else None
        model = _Hybrid(emb, _linear(0, 6, 5 if head else 2), head)
        params = emb.remote_parameters() + (head.remote_parameters() if head else [])
        params += [rpc.RRef(p) for p in model.local.parameters()]
        optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=0.05, momentum=0.9)
        losses = []
        for indices, offsets, target in _batches():
            with dist_autograd.context() as context_id:
                loss = nn.functional.cross_entropy(model(indices, offsets), target)
                dist_autograd.backward(context_id, [loss])
                optimizer.step(context_id)
            losses.append(loss.detach())
        out = losses, [p.to_here().detach() for p in params]
    rpc.shutdown()
    return out


def _train_local(world_size):
    head = _linear(2, 5, 2) if world_size == 3 else None
    model = _Hybrid(_embedding(1), _linear(0, 6, 5 if head else 2), head)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for indices, offsets, target in _batches():
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(indices, offsets), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    params = list(model.emb.parameters()) + (list(head.parameters()) if head else [])
    return losses, [p.detach() for p in params + list(model.local.parameters())]


@pytest.mark.parametrize("world_size", [2, 3])
def test_remote_parameters_train_with_distributed_optimizer_as_local_training(world_size):
    losses, params = run_ranks(_train_remote, world_size, timeout=60)[0]
    ref_losses, ref_params = _train_local(world_size)
    assert torch.allclose(torch.stack(losses), torch.stack(ref_losses), atol=1e-6), (losses, ref_losses)
    assert not torch.allclose(losses[0], losses[-1])  # it did train
    assert len(params) == len(ref_params)
    for got, ref in zip(params, ref_params):
        assert torch.allclose(got, ref, atol=1e-6)


# -- what RemoteModule refuses: the same errors as torch's -------------------------------------
def _torch_refusals() -> dict[str, tuple[tuple, str]]:
    """Every public method of torch's RemoteModule that refuses: its dummy arguments and its message."""
    from torch.distributed.nn.api.remote_module import _RemoteModule as TorchRemoteModule

    dummy = object.__new__(TorchRemoteModule)
    refusals = {}
    for method_name, fn in vars(TorchRemoteModule).items():
        if method_name.startswith("_") or not inspect.isfunction(fn):
            continue
        required = [p for p in list(inspect.signature(fn).parameters.values())[1:]
                    if p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
        args = (None,) * len(required)
        try:
            fn(dummy, *args)
        except ValueError as exc:
            if "not supported for RemoteModule" in str(exc):
                refusals[method_name] = (args, str(exc))
        except Exception:  # noqa: BLE001 - a method that needs a real instance: not a refusal
            pass
    return refusals


def _refusals_and_modes(rank, world_size, refusals):
    start(rank, world_size)
    out = {}
    if rank == 0:
        rm = RemoteModule(name(1), Net, args=(1,))
        for method_name, (args, _) in refusals.items():
            try:
                getattr(rm, method_name)(*args)
                out[method_name] = None
            except ValueError as exc:
                out[method_name] = str(exc)
        for key, fn in {"repr": lambda: repr(rm), "register_module": lambda: rm.register_module("m", None),
                        "pickle": lambda: pickle.dumps(rm), "deepcopy": lambda: copy.deepcopy(rm),
                        "bad_cls": lambda: RemoteModule(name(1), NotAModule).forward(torch.ones(1)),
                        "bad_forward": lambda: rm.forward(torch.ones(2, 4), 1, 2, 3)}.items():
            try:
                fn()
            except Exception as exc:  # noqa: BLE001
                out[key] = (type(exc), str(exc))

        def remote_training():
            return rpc.rpc_sync(name(1), _training_of, args=(rm.get_module_rref(),))

        evaluated = rm.eval()
        out["eval"] = (type(evaluated), evaluated.training, remote_training(), rm.training)
        trained = rm.train(False)  # torch 2.13 ignores the mode: the remote module trains
        out["train_false"] = (type(trained), trained.training, remote_training(), rm.training)
        rm.eval()
        out["train"] = (rm.train().training, remote_training())
    rpc.shutdown()
    return out


def _training_of(module_rref):
    module = module_rref.local_value()
    return module.training, module.lin.training


def test_refused_methods_train_eval_and_pickling_behave_as_torch():
    refusals = _torch_refusals()
    assert len(refusals) >= 28 and "parameters" in refusals and "to" in refusals, sorted(refusals)
    out = run_ranks(_refusals_and_modes, 2, args=(refusals,), timeout=60)[0]
    for method_name, (_, message) in refusals.items():
        assert out[method_name] == message, method_name
    assert out["parameters"].endswith("Please use ``remote_parameters`` instead.")
    assert out["repr"] == (ValueError, "Method ``extra_repr`` not supported for RemoteModule")
    assert out["register_module"] == (ValueError, "Method ``add_module`` not supported for RemoteModule")
    not_rpc = "Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled when using RPC"
    assert out["pickle"] == (RuntimeError, not_rpc) and out["deepcopy"] == (RuntimeError, not_rpc)
    assert out["bad_cls"][0] is ValueError
    assert "Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>" in out["bad_cls"][1]
    assert out["bad_forward"][0] is TypeError and "positional arguments but 5 were given" in out["bad_forward"][1]
    assert out["eval"] == (Net, False, (False, False), True)
    assert out["train_false"] == (Net, True, (True, True), True)
    assert out["train"] == (True, (True, True))


# -- remote_device ------------------------------------------------------------------------------
_DEVICES = ["worker1/cpu", "rank:1/cpu", "worker1", "rank:1", "rank:1/cpu:0", "cpu", "", "/cpu", "worker1/",
            "worker1/cpu/extra", "rank:x/cpu", "a:b:c/cpu", "foo:1/cpu", "worker1/notadevice", "rank:-1/cpu", 123]


def _torch_parse(remote_device):
    from torch.distributed.remote_device import _remote_device

    parsed = _remote_device(remote_device)
    worker = parsed.worker_name() if parsed.worker_name() is not None else parsed.rank()
    return worker, parsed.device()


def _outcome(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001
        return type(exc), str(exc)


@pytest.mark.parametrize("remote_device", _DEVICES)
def test_remote_device_strings_parse_as_torch_parses_them(remote_device):
    assert _outcome(_parse_remote_device, remote_device) == _outcome(_torch_parse, remote_device)


def test_remote_module_needs_rpc():
    with pytest.raises(AssertionError, match="RemoteModule only works in RPC"):
        RemoteModule("worker1/cpu", nn.Linear, args=(2, 2))


def _bad_devices(rank, world_size):
    start(rank, world_size)
    out = {}
    if rank == 0:
        for device in ["nobody/cpu", f"rank:{world_size}/cpu", "cpu", "worker1/cpu/extra", "worker1/", 7]:
            out[device] = _outcome(lambda d: RemoteModule(d, Net, args=(0,)), device)
    rpc.shutdown()
    return out


def test_bad_remote_devices_raise_before_anything_is_created():
    out = run_ranks(_bad_devices, 2, timeout=60)[0]
    assert out["nobody/cpu"] == (RuntimeError, "name:worker0,rank:0 could not find destination name nobody")
    assert out["rank:2/cpu"] == (RuntimeError, "name:worker0,rank:0 could not find destination id 2")
    assert out["cpu"][0] is TypeError  # torch: its agent's get_worker_info(None) refuses the missing worker
    assert out["worker1/cpu/extra"] == (ValueError, "Could not parse remote_device: worker1/cpu/extra. The valid "
                                        "format is '<workername>/<device>' or 'rank:<rank>/<device>' or '<device>'")
    assert out["worker1/"] == (RuntimeError, "Device string must not be empty")
    assert out[7] == (TypeError, "Invalid type for remote_device: <class 'int'>")


# -- over RPC, and init_from_module_rref --------------------------------------------------------
_ATTRIBUTES = ("on", "device", "is_device_map_set", "is_scriptable", "generated_methods")


def _use_received(rm, x):
    """On the receiver: the RemoteModule works as the sender's does."""
    assert isinstance(rm, RemoteModule)
    return ({attr: getattr(rm, attr) for attr in _ATTRIBUTES}, rm.forward(x), rm.forward_async(x, 2.0).wait(), rm(x),
            [p.to_here() for p in rm.remote_parameters()], rm.training)


def _scale_in_place(module_rref, factor):
    with torch.no_grad():
        module_rref.local_value().scale.mul_(factor)


def _over_rpc(rank, world_size):
    start(rank, world_size)
    out = {}
    if rank == 0:
        x = _inputs()
        third = name(world_size - 1)  # worker2, a third party; with two workers, the owner itself
        rm = RemoteModule("worker1/cpu", Net, args=(1,))
        out["sender"] = {attr: getattr(rm, attr) for attr in _ATTRIBUTES}
        out["third"] = rpc.rpc_sync(third, _use_received, args=(rm, x))
        out["owner"] = rpc.rpc_sync(name(1), _use_received, args=(rm, x))
        out["back"] = _use_received(rpc.rpc_sync(third, _echo, args=(rm,)), x)
        # init_from_module_rref: here, and on another worker that returns its RemoteModule over RPC
        shared = RemoteModule.init_from_module_rref("worker1/cpu", rm.get_module_rref())
        built_there = rpc.rpc_sync(third, RemoteModule.init_from_module_rref, args=("rank:1/cpu", rm.get_module_rref()))
        out["shared"] = _use_received(shared, x)
        out["built_there"] = _use_received(built_there, x)
        rpc.rpc_sync(name(1), _scale_in_place, args=(rm.get_module_rref(), 2.0))
        out["after_scaling"] = (rm.forward(x), shared.forward(x), built_there.forward(x))
    rpc.shutdown()
    return out


def _echo(value):
    return value


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_remote_module_sent_over_rpc_and_init_from_module_rref_share_the_module(world_size):
    out = run_ranks(_over_rpc, world_size, timeout=60)[0]
    x, local = _inputs(), Net(1)
    expected = (local(x), local(x, 2.0), local(x), list(local.parameters()))
    for key in ("third", "owner", "back", "shared", "built_there"):
        attributes, forward, forward_async, call, params, training = out[key]
        on = 1 if key == "built_there" else "worker1"
        assert attributes == {**out["sender"], "on": on}, key
        for got, ref in zip((forward, forward_async, call), expected):
            assert torch.equal(got, ref), key
        assert all(torch.equal(a, b) for a, b in zip(params, expected[3])), key
        assert training is True
    assert out["sender"]["generated_methods"][0].__name__ == "forward_async"
    with torch.no_grad():
        local.scale.mul_(2.0)
    assert all(torch.equal(got, local(x)) for got in out["after_scaling"])
