"""fully_shard: the same training programs on torch's FSDP2 (gloo) and on torchdist give the same parameters.

One spawn per world size runs every scenario on torch, then on torchdist, in
the same processes, and returns what each saw; the tests compare torchdist's
observations with torch's and the trained parameters with single-process
training on the concatenated batches. World
sizes 1-4 with odd layer sizes make uneven shards (ranks with fewer or no rows).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from torchdist.testing import free_port

from ._common import OncePerWorldSize, batches, libs, loss_of, make_model, optimizer, train_reference

WORLD_SIZES = (1, 2, 3, 4)
MICRO_BATCHES = 2
CLIP = 0.3  # below the gradients' norm (0.45 to 1.2 here), so clipping changes them


def _outcome(fn):
    """What ``fn()`` returned, or its error's type name (the observation when it raises)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - the error is the observation
        return ("raised", type(exc).__name__)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor().detach().float() if hasattr(tensor, "full_tensor") else tensor.detach().float()


def _shard(fsdp, model: nn.Module, kind: str, **kwargs) -> None:
    """Bottom-up: each layer or block, then the root."""
    children = model.layers if kind == "mlp" else model.blocks
    for child in children:
        fsdp.fully_shard(child, **kwargs)
    fsdp.fully_shard(model, **kwargs)


def _fsdp_modules(fsdp, model: nn.Module) -> list:
    return [m for m in model.modules() if isinstance(m, fsdp.FSDPModule)]


def _train(fsdp, rank: int, world_size: int, kind: str, *, accumulate: int = 1, prefetch: bool = False,
           keep_unsharded: bool = False, defer_all_reduce: bool = False, divide_by: float | None = None,
           optim: str = "adamw", reload: bool = False, recompute: bool = False, clip: float | None = None,
           custom_comms: bool = False, **shard_kwargs) -> dict[str, torch.Tensor]:
    """Train with FSDP; return the full tensors of the state dict (DTensors, like the parameters)."""
    model = make_model(kind)
    if recompute:  # activation checkpointing inside each block: its forward runs again in backward
        for block in model.blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    _shard(fsdp, model, kind, **shard_kwargs)
    if prefetch:  # explicit prefetching must not change results
        blocks = list(model.blocks)
        blocks[0].set_modules_to_forward_prefetch(blocks[1:])
        blocks[-1].set_modules_to_backward_prefetch(blocks[:-1])
    if divide_by is not None:  # the sum divided by a custom factor instead of the average
        for module in _fsdp_modules(fsdp, model):
            module.set_gradient_divide_factor(divide_by)
            module.set_force_sum_reduction_for_comms(True)
    if custom_comms:  # the user's all-gather and reduce-scatter replace FSDP's
        calls = _set_counting_comms(fsdp, _fsdp_modules(fsdp, model))
    opt = optimizer(optim, model.parameters())
    for x, y in batches(kind, world_size):
        xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        for i, (xm, ym) in enumerate(zip(xs.chunk(accumulate), ys.chunk(accumulate))):
            last = i == accumulate - 1
            if defer_all_reduce:  # HSDP: reduce-scatter every micro-batch, all-reduce the sum at the last
                model.set_requires_all_reduce(last)
            else:
                model.set_requires_gradient_sync(last)
            if keep_unsharded:  # micro-batches keep the gathered parameters: no all-gather in between
                model.set_reshard_after_backward(last)
            loss_of(kind, model(xm), ym).backward()
            if not last and not keep_unsharded:  # without sync nothing is reduced yet
                assert all(p.grad is None for p in model.parameters())
        if clip is not None:  # the norm of sharded DTensor gradients is the norm of the full ones
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    if custom_comms:
        steps = len(batches(kind, world_size)) if world_size > 1 else 0  # one rank: no collective at all
        groups = len([m for m in calls["modules"] if any(True for _ in m.parameters(recurse=False))])
        assert calls["all_gather"] >= steps and calls["reduce_scatter"] == groups * steps, calls
    state = model.state_dict()
    if reload:  # a fresh sharded model loads the DTensor state dict and computes the same outputs
        fresh = make_model(kind)
        _shard(fsdp, fresh, kind, **shard_kwargs)
        fresh.load_state_dict(state)
        x = batches(kind, world_size)[0][0].chunk(world_size)[rank]
        with torch.no_grad():
            assert torch.equal(fresh(x), model(x))
        state = fresh.state_dict()
    return {name: _full(value) for name, value in state.items()}


def _set_counting_comms(fsdp, modules: list) -> dict:
    """Give ``modules`` an all-gather and a reduce-scatter of the user's (subclasses of the library's interfaces,
    calling its c10d ops); returns the counts of their calls."""
    import importlib

    torch_lib = fsdp.__name__.startswith("torch.")
    api = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_api" if torch_lib else
                                  "torchdist.fsdp._api")
    c10d = importlib.import_module("torch.distributed" if torch_lib else "torchdist")
    calls = {"all_gather": 0, "reduce_scatter": 0, "modules": modules}

    class CountingAllGather(api.AllGather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            calls["all_gather"] += 1
            return c10d.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)

    class CountingReduceScatter(api.ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            calls["reduce_scatter"] += 1
            return c10d.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    for module in modules:
        module.set_custom_all_gather(CountingAllGather())
        module.set_custom_reduce_scatter(CountingReduceScatter())
    return calls


def _observe_api(c10d, fsdp, rank: int, world_size: int) -> dict:
    """Types, placements, shapes and errors a user can see, before, during and after one step."""
    model = make_model("mlp")
    for layer in model.layers[:2]:  # the last layer's parameters go to the root's group
        fsdp.fully_shard(layer)
    fsdp.fully_shard(model)
    seen: dict = {"classes": [type(m).__name__ for m in model.modules()]}
    seen["params"] = [(n, type(p).__name__, isinstance(p, nn.Parameter), tuple(p.shape), str(p.placements),
                       tuple(p.to_local().shape), p.requires_grad) for n, p in model.named_parameters()]
    seen["state_dict"] = [(k, type(v).__name__, tuple(v.shape), tuple(v.to_local().shape))
                          for k, v in model.state_dict().items()]
    x, y = batches("mlp", world_size)[0]
    out = model(x.chunk(world_size)[rank])
    # the root keeps its parameters unsharded between forward and backward, the layers reshard
    seen["after_forward"] = [(n, type(p).__name__, tuple(p.shape)) for n, p in model.named_parameters()]
    if fsdp.__name__.startswith("torchdist"):  # and the layers' gathered storage is really freed
        assert all(_storage_bytes(m) == 0 for m in model.layers[:2]), "layers keep their gathered parameters"
        assert _storage_bytes(model) == 4 * (2 * 3 + 2), "the root should keep its gathered parameters"
    loss_of("mlp", out, y.chunk(world_size)[rank]).backward()
    if fsdp.__name__.startswith("torchdist"):  # after backward everything is sharded again
        assert all(_storage_bytes(m) == 0 for m in (model, *model.layers[:2]))
    seen["after_backward"] = [(n, type(p).__name__, type(p.grad).__name__, str(p.grad.placements),
                               tuple(p.grad.to_local().shape)) for n, p in model.named_parameters()]
    layer = model.layers[0]
    handle = layer.unshard(async_op=True)
    handle.wait()
    seen["unsharded"] = [(n, type(p).__name__, tuple(p.shape)) for n, p in layer.named_parameters()]
    layer.reshard()
    seen["resharded"] = [(n, type(p).__name__) for n, p in layer.named_parameters()]
    fsdp.register_fsdp_forward_method(model, "tail")  # gathers the root's parameters around model.tail
    seen["forward_method"] = model.tail(torch.ones(2, 3)).detach()
    seen["forward_method_after"] = [(n, type(p).__name__) for n, p in model.named_parameters()]
    seen["errors"] = {
        "container": _outcome(lambda: fsdp.fully_shard(nn.ModuleList([nn.Linear(2, 2)]))),
        "scalar": _outcome(lambda: fsdp.fully_shard(_WithScalar())),
        "raf_int": _outcome(lambda: fsdp.fully_shard(nn.Linear(2, 2), reshard_after_forward=world_size + 1)),
        "raf_type": _outcome(lambda: model.set_reshard_after_forward("yes")),
        "prefetch": _outcome(lambda: model.set_modules_to_forward_prefetch([nn.Linear(2, 2)])),
        "deepcopy": _outcome(lambda: __import__("copy").deepcopy(model)),
        "reset_not_root": _outcome(lambda: model.layers[0].reset_iter_state()),
        "twice": _outcome(lambda: fsdp.fully_shard(model)),
    }
    seen["policies"] = (repr(fsdp.MixedPrecisionPolicy(torch.bfloat16)), repr(fsdp.CPUOffloadPolicy()),
                        repr(fsdp.OffloadPolicy()))
    return seen


def _storage_bytes(module: nn.Module) -> int:
    """Bytes held by the unsharded parameters of torchdist's group of ``module``."""
    group = module._get_fsdp_state().param_group
    return sum(p._unsharded.untyped_storage().size() for p in group.params if p._unsharded is not None)


class _WithScalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0))


def _run(rank: int, world_size: int, lib: str) -> dict:
    c10d, fsdp, init_device_mesh = libs(lib)
    mp = fsdp.MixedPrecisionPolicy
    got = {
        "api": _observe_api(c10d, fsdp, rank, world_size),
        **{name: _train(fsdp, rank, world_size, kind, **kwargs) for name, (kind, kwargs) in SCENARIOS.items()},
        "mixed": _train(fsdp, rank, world_size, "transformer", optim="sgd",
                        mp_policy=mp(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
        "fp16_reduce": _train(fsdp, rank, world_size, "mlp", optim="sgd", mp_policy=mp(reduce_dtype=torch.float16)),
        "divided": _train(fsdp, rank, world_size, "mlp", optim="sgd", divide_by=2.0 * world_size),
        "variants": _train_variants(c10d, fsdp, rank, world_size),
    }
    if world_size == 4:  # HSDP: replicate over 2, shard over 2
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        got["hsdp"] = _train(fsdp, rank, world_size, "transformer", mesh=mesh)
        got["hsdp_no_sync"] = _train(fsdp, rank, world_size, "mlp", mesh=mesh, accumulate=MICRO_BATCHES)
        got["hsdp_deferred"] = _train(fsdp, rank, world_size, "mlp", mesh=mesh, accumulate=MICRO_BATCHES,
                                      defer_all_reduce=True)
        got["raf_int"] = _train(fsdp, rank, world_size, "transformer", reshard_after_forward=2)
        got["raf_int_params"] = _observe_post_forward(fsdp, rank, world_size)
        model = make_model("transformer")
        _shard(fsdp, model, "transformer", mesh=mesh)
        got["hsdp_params"] = [(n, str(p.placements), tuple(p.to_local().shape)) for n, p in model.named_parameters()]
    return got


def _train_variants(c10d, fsdp, rank: int, world_size: int) -> dict:
    """A frozen parameter, ignored parameters (reduced by hand) and Shard(1) where it divides evenly; the state
    dict's full tensors and the parameters' types, placements and requires_grad."""
    shard_cls = _placement_module(fsdp).Shard
    model = make_model("transformer")
    model.blocks[0].norm1.weight.requires_grad_(False)
    ignored = {model.head.bias, model.blocks[1].up.weight}
    options = {"ignored_params": ignored,
               "shard_placement_fn": lambda p: shard_cls(1) if p.dim() == 2 and p.shape[1] % world_size == 0 else None}
    _shard(fsdp, model, "transformer", **options)
    opt = optimizer("adamw", [p for p in model.parameters() if p.requires_grad])
    for x, y in batches("transformer", world_size):
        loss_of("transformer", model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
        for param in ignored:  # FSDP leaves them alone: plain tensors with local gradients
            c10d.all_reduce(param.grad)
            param.grad /= world_size
        opt.step()
        opt.zero_grad()
    return {"state": {name: _full(value) for name, value in model.state_dict().items()},
            "params": [(n, type(p).__name__, str(getattr(p, "placements", None)), p.requires_grad)
                       for n, p in model.named_parameters()]}


def _observe_post_forward(fsdp, rank: int, world_size: int) -> list:
    """``reshard_after_forward=2`` at world size 4: between forward and backward a block holds half-size shards on
    a (2, 2) mesh; after backward the usual shards again."""
    model = make_model("transformer")
    for block in model.blocks:
        fsdp.fully_shard(block, reshard_after_forward=2)
    fsdp.fully_shard(model)
    x, y = batches("transformer", world_size)[0]
    loss = loss_of("transformer", model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank])
    seen = [(n, str(p.placements), p.device_mesh.shape, tuple(p.to_local().shape), p.dtype)
            for n, p in model.blocks[0].named_parameters()]
    loss.backward()
    return seen + [(n, str(p.placements), p.device_mesh.shape, tuple(p.to_local().shape))
                   for n, p in model.blocks[0].named_parameters()]


def _placement_module(fsdp):
    import importlib

    return importlib.import_module("torch.distributed.tensor" if fsdp.__name__.startswith("torch.") else
                                   "torchdist.tensor")


def _run_both(rank: int, world_size: int) -> tuple[dict, dict]:
    """torch's observations, then torchdist's, in the same processes (one spawn per world size)."""
    import torch.distributed as tdist

    import torchdist

    want = _run(rank, world_size, "torch")
    port = [free_port() if rank == 0 else None]
    tdist.broadcast_object_list(port, src=0)  # a free port for torchdist's store, chosen once
    tdist.destroy_process_group()
    torchdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port[0]}", rank=rank, world_size=world_size)
    try:
        return want, _run(rank, world_size, "torchdist")
    finally:
        torchdist.destroy_process_group()


#: name: (model, _train options); each must equal single-process training (the same options without FSDP)
SCENARIOS = {
    "mlp": ("mlp", {"reload": True}),
    "mlp_keep": ("mlp", {"reshard_after_forward": False}),
    "transformer": ("transformer", {"prefetch": True, "reload": True}),
    "no_sync": ("mlp", {"accumulate": MICRO_BATCHES}),
    "no_sync_unsharded": ("mlp", {"accumulate": MICRO_BATCHES, "keep_unsharded": True}),
    "recompute_clip_foreach": ("transformer", {"recompute": True, "clip": CLIP, "optim": "adamw_foreach"}),
    "custom_comms": ("mlp", {"custom_comms": True}),
}


_results = OncePerWorldSize(_run_both)  # one spawn per world size for the whole module


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def runs(request):
    return _results(request.param)


def _assert_params_close(got: dict, want: dict, what: str, **tol) -> None:
    assert got.keys() == want.keys(), what
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m: f"{what}, {name}: {m}", **tol)


def test_api_observations_match_torch(runs):
    world_size, want, got = runs
    for rank in range(world_size):
        for key, value in want[rank]["api"].items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(got[rank]["api"][key], value, msg=lambda m: f"rank {rank}, {key}: {m}")
            else:
                assert got[rank]["api"][key] == value, f"rank {rank}, {key}"


def _check_scenario(runs, scenario: str, reference: dict, **tol) -> None:
    world_size, want, got = runs
    for rank in range(world_size):
        _assert_params_close(got[rank][scenario], reference, f"{scenario} rank {rank} vs single process", **tol)
        _assert_params_close(got[rank][scenario], want[rank][scenario], f"{scenario} rank {rank} vs torch",
                             rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_training_matches_single_process_and_torch(runs, scenario):
    kind, options = SCENARIOS[scenario]
    reference = train_reference(kind, runs[0], options.get("accumulate", 1), clip=options.get("clip"))
    _check_scenario(runs, scenario, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scenario,kind,accumulate", [
    ("hsdp", "transformer", 1), ("hsdp_no_sync", "mlp", MICRO_BATCHES), ("hsdp_deferred", "mlp", MICRO_BATCHES),
    ("raf_int", "transformer", 1),
])
def test_hsdp_and_int_reshard_match_single_process_and_torch(scenario, kind, accumulate):
    # world size 4 only: a (2, 2) mesh, and reshard_after_forward=2
    _check_scenario(_results(4), scenario, train_reference(kind, 4, accumulate), rtol=1e-4, atol=1e-5)


def test_hsdp_and_post_forward_placements_like_torch():
    _, want, got = _results(4)
    for rank in range(4):
        assert got[rank]["hsdp_params"] == want[rank]["hsdp_params"]
        assert all(placements == "(Replicate(), Shard(dim=0))" for _, placements, _ in got[rank]["hsdp_params"])
        assert got[rank]["raf_int_params"] == want[rank]["raf_int_params"]


def test_frozen_ignored_and_shard1_parameters_like_torch(runs):
    world_size, want, got = runs
    for rank in range(world_size):
        assert got[rank]["variants"]["params"] == want[rank]["variants"]["params"]
        _assert_params_close(got[rank]["variants"]["state"], want[rank]["variants"]["state"], f"rank {rank}",
                             rtol=1e-5, atol=1e-6)
    placements = {placement for _, _, placement, _ in got[0]["variants"]["params"]}
    assert "None" in placements  # the ignored parameters stay plain tensors
    if world_size in (1, 2):  # some second dims divide evenly: Shard(1) where asked
        assert "(Shard(dim=1),)" in placements


def test_custom_divide_factor_scales_gradients(runs):
    # the summed gradients divided by 2*W: half the average, so SGD moves half as far. At world size 1 PyTorch
    # 2.13 divides twice (once in place of the reduce-scatter, once after it): a quarter; torchdist does the same.
    world_size = runs[0]
    scaled = train_reference("mlp", world_size, optim="sgd", lr_scale=0.25 if world_size == 1 else 0.5)
    _check_scenario(runs, "divided", scaled, rtol=1e-4, atol=1e-5)


def test_mixed_precision_close_to_fp32_and_torch(runs):
    world_size, want, got = runs
    for scenario, kind, atol in (("mixed", "transformer", 1e-2), ("fp16_reduce", "mlp", 1e-3)):
        reference = train_reference(kind, world_size, optim="sgd")
        for rank in range(world_size):
            # low-precision compute or reduction (SGD: the updates carry the gradients' relative error)
            _assert_params_close(got[rank][scenario], reference, f"{scenario} vs fp32", rtol=0, atol=atol)
            # torch does the same arithmetic
            _assert_params_close(got[rank][scenario], want[rank][scenario], f"{scenario} vs torch", rtol=0,
                                 atol=atol / 5)
