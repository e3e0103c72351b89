"""``fully_shard(model, mesh=full_mesh, dp_mesh_dims=DataParallelMeshDims(...))``: FSDP2 on a full SPMD mesh.

The parameters are DTensors on the user's whole mesh (Replicate() on the data-parallel dims, maybe Shard on
others), the inputs DTensors sharded on the batch over the data-parallel dims. One spawn per mesh (4 or 8 ranks) runs
the same program on torch's FSDP2 (gloo) and then on torchdist's, in the same processes: the sharded parameters'
layouts (mesh names and shape in the user's dim order, placements with ``Shard``/``_StridedShard`` in the shard
dim's place), the unsharded parameters seen in forward, the gradients, the losses and the parameters after training
with an optimizer. Both are also compared with training the undistributed model in one process. The validation
errors are compared with torch's messages. ``replicate`` alone (no ``shard``) is DDP-style: parameters keep their
layout and gradients are all-reduced over the replicate dims.
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torchdist.testing import free_port, run_ranks

STEPS = 3
LOCAL_BATCH = 2
LR = 0.05

#: name: (mesh dim names (a mesh of size 2 in every dim: world 4 or 8), DataParallelMeshDims kwargs, placement
#: per parameter (default: Replicate() everywhere), optimizer); placements are written on the mesh's dims:
#: "R" Replicate(), "S0"/"S1" Shard(0)/Shard(1)
CONFIGS = {
    "dp_tp_replicated": (("dp", "tp"), {"shard": "dp"}, {}, "adam"),
    "dp_tp_sharded": (("dp", "tp"), {"shard": "dp"},
                      {"l1.weight": ("R", "S0"), "l1.bias": ("R", "S0"), "l2.weight": ("R", "S1")}, "sgd"),
    "tp_dp_sharded": (("tp", "dp"), {"shard": "dp"},
                      {"l1.weight": ("S0", "R"), "l1.bias": ("S0", "R"), "l2.weight": ("S1", "R")}, "adamw"),
    "hsdp": (("rep", "shard"), {"shard": "shard", "replicate": "rep"}, {}, "adam"),
    "flattened_shard": (("a", "b"), {"shard": ("a", "b")}, {}, "sgd"),
    "replicate_only_tp_sharded": (("dp", "tp"), {"replicate": "dp"},
                                  {"l1.weight": ("R", "S0"), "l1.bias": ("R", "S0"), "l2.weight": ("R", "S1")}, "sgd"),
    "hsdp_tp_sharded": (("rep", "shard", "tp"), {"shard": "shard", "replicate": "rep"},
                        {"l1.weight": ("R", "R", "S0"), "l1.bias": ("R", "R", "S0"), "l2.weight": ("R", "R", "S1")},
                        "adam"),
    "hsdp_flattened_shard": (("rep", "a", "b"), {"shard": ("a", "b"), "replicate": "rep"}, {}, "sgd"),
}


class Net(nn.Module):
    """Odd sizes: FSDP's shards are uneven, and over 4 ranks one rank holds no row of ``l2``."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(5, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(F.relu(self.l1(x)))


def make_model() -> Net:
    torch.manual_seed(0)
    return Net()


def world(config: str) -> int:
    return 2 ** len(CONFIGS[config][0])


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches of 16 (LOCAL_BATCH rows for each of up to 8 data-parallel ranks)."""
    g = torch.Generator().manual_seed(1)
    n = LOCAL_BATCH * 8
    return [(torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g)) for _ in range(STEPS)]


def dp_size(config: str) -> int:
    names, dims, _, _ = CONFIGS[config]
    dp = [n for n in names if n in _names(dims.get("shard")) + _names(dims.get("replicate"))]
    return 2 ** len(dp)


def _names(value) -> tuple:
    return () if value is None else (value,) if isinstance(value, str) else tuple(value)


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=LR, momentum=0.9)
    return (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(params, lr=LR, foreach=False)


def train_reference(config: str) -> tuple[list[list[float]], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, whole batches: each data-parallel chunk's loss divided by the number of chunks, as FSDP
    averages gradients. Returns each step's per-chunk losses, the first step's gradients and the trained
    parameters."""
    dp = dp_size(config)
    model = make_model()
    opt = make_optimizer(CONFIGS[config][3], model.parameters())
    losses = []
    for x, y in batches():
        step = []
        for xs, ys in zip(x.chunk(dp), y.chunk(dp)):
            loss = F.mse_loss(model(xs), ys)
            (loss / dp).backward()
            step.append(loss.item())
        losses.append(step)
        if len(losses) == 1:
            first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return losses, first_grads, {n: p.detach().clone() for n, p in model.named_parameters()}


# -- what runs on the ranks ---------------------------------------------------------------------------------------


class _Lib:
    """torch's or torchdist's fully_shard, DataParallelMeshDims, init_device_mesh and DTensor API."""

    def __init__(self, lib: str) -> None:
        prefix = "torch.distributed" if lib == "torch" else "torchdist"
        fsdp, tensor = (importlib.import_module(f"{prefix}.{m}") for m in ("fsdp", "tensor"))
        self.fully_shard, self.Dims = fsdp.fully_shard, fsdp.DataParallelMeshDims
        self.init_device_mesh = importlib.import_module(f"{prefix}.device_mesh").init_device_mesh
        self.DTensor, self.distribute_tensor = tensor.DTensor, tensor.distribute_tensor
        self.placement = {"R": tensor.Replicate(), "S0": tensor.Shard(0), "S1": tensor.Shard(1)}

    def mesh(self, names: tuple[str, ...] | None, ndim: int = 2):
        return self.init_device_mesh("cpu", (2,) * (len(names) if names else ndim), mesh_dim_names=names)

    def distribute(self, model: nn.Module, mesh, layouts: dict, skip: str | None = None) -> nn.Module:
        """Every parameter (but ``skip``) a DTensor on ``mesh``: its layout from ``layouts``, else replicated."""
        for fqn, param in list(model.named_parameters()):
            if fqn == skip:
                continue
            owner, name = model.get_submodule(fqn.rpartition(".")[0]), fqn.rpartition(".")[2]
            placements = [self.placement[p] for p in layouts.get(fqn, ("R",) * mesh.ndim)]
            setattr(owner, name, nn.Parameter(self.distribute_tensor(param.detach(), mesh, placements)))
        return model


def _data_placements(lib: _Lib, config: str) -> list:
    """The batch sharded over the data-parallel dims (in mesh order: chunk = row-major index over them)."""
    names, dims, _, _ = CONFIGS[config]
    dp = set(_names(dims.get("shard")) + _names(dims.get("replicate")))
    return [lib.placement["S0" if n in dp else "R"] for n in names]


def _local_batch(config: str, mesh, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    names, dims, _, _ = CONFIGS[config]
    dp = set(_names(dims.get("shard")) + _names(dims.get("replicate")))
    chunk = 0
    for name, coordinate in zip(names, mesh.get_coordinate()):
        if name in dp:
            chunk = chunk * 2 + coordinate
    x, y = batches()[step]
    return x.chunk(dp_size(config))[chunk], y.chunk(dp_size(config))[chunk]


def _layout(tensor: torch.Tensor) -> tuple:
    mesh = getattr(tensor, "device_mesh", None)
    return (type(tensor).__name__, str(getattr(tensor, "placements", None)),
            None if mesh is None else (mesh.mesh_dim_names, tuple(mesh.shape)), tuple(tensor.shape),
            tuple(tensor.to_local().shape) if hasattr(tensor, "to_local") else None)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor().detach().clone() if hasattr(tensor, "full_tensor") else tensor.detach().clone()


def _run(lib_name: str, config: str) -> dict:
    """Shard ``l1`` then the root on the full mesh, look at the layouts, train ``STEPS`` steps."""
    lib = _Lib(lib_name)
    names, dims, layouts, optimizer = CONFIGS[config]
    mesh = lib.mesh(names)
    model = lib.distribute(make_model(), mesh, layouts)
    lib.fully_shard(model.l1, mesh=mesh, dp_mesh_dims=lib.Dims(**dims))
    lib.fully_shard(model, mesh=mesh, dp_mesh_dims=lib.Dims(**dims))
    seen = {"params": [(n, *_layout(p)) for n, p in model.named_parameters()],
            "initial": {n: _full(p) for n, p in model.named_parameters()}}
    model.l1.unshard()
    seen["unsharded"] = [(n, *_layout(p)) for n, p in model.l1.named_parameters()]
    model.l1.reshard()
    opt = make_optimizer(optimizer, model.parameters())
    placements = _data_placements(lib, config)
    seen["losses"] = []
    for step in range(STEPS):
        x, y = _local_batch(config, mesh, step)
        out = model(lib.DTensor.from_local(x, mesh, placements))
        loss = F.mse_loss(out.redistribute(mesh, placements).to_local(), y)
        loss.backward()
        seen["losses"].append(loss.item())
        if step == 0:
            seen["grads"] = [(n, *_layout(p.grad)) for n, p in model.named_parameters()]
            seen["first_grads"] = {n: _full(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    seen["trained"] = {n: _full(p) for n, p in model.named_parameters()}
    return seen


def _error(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the type and message are what is compared
        return type(exc).__name__, str(exc)
    return None


def _errors(lib_name: str) -> dict:
    """Each misuse on a fresh model; (exception type, message) or None."""
    lib = _Lib(lib_name)
    mesh = lib.mesh(("dp", "tp"))
    hsdp_mesh = lib.mesh(("rep", "shard"))

    def shard(model, dims, on=mesh, **kwargs):
        return lambda: lib.fully_shard(model, mesh=on, dp_mesh_dims=dims, **kwargs)

    def replicated(on=mesh, **kwargs):
        return lib.distribute(make_model(), on, kwargs.pop("layouts", {}), **kwargs)

    return {
        "no_dims": _error(lambda: lib.Dims()),
        "unknown_name": _error(shard(replicated(), lib.Dims(shard="fsdp"))),
        "unknown_replicate_name": _error(shard(replicated(), lib.Dims(shard="dp", replicate=("x",)))),
        "unnamed_mesh": _error(lambda: lib.fully_shard(replicated(), mesh=lib.mesh(None),
                                                       dp_mesh_dims=lib.Dims(shard="dp"))),
        "plain_parameter": _error(shard(replicated(skip="l2.bias"), lib.Dims(shard="dp"))),
        "other_mesh": _error(shard(replicated(on=lib.mesh(("dp", "tp"))), lib.Dims(shard="dp"))),
        "sharded_on_dp": _error(shard(replicated(layouts={"l1.weight": ("S0", "R")}), lib.Dims(shard="dp"))),
        "sharded_on_replicate": _error(shard(replicated(on=hsdp_mesh, layouts={"l2.weight": ("S1", "R")}),
                                             lib.Dims(shard="shard", replicate="rep"), on=hsdp_mesh)),
        "int_reshard": _error(shard(replicated(), lib.Dims(shard="dp"), reshard_after_forward=2)),
        # replicate-only has nothing to reshard: torch does not look at reshard_after_forward at all
        "replicate_only_int_reshard": _error(shard(replicated(), lib.Dims(replicate="dp"), reshard_after_forward=3)),
    }


def _run_both(rank: int, world_size: int, config: str) -> tuple[dict, dict]:
    """torch's run, then torchdist's, in the same processes (config "errors": the validation errors)."""
    import torch.distributed as tdist

    import torchdist

    run = _errors if config == "errors" else lambda lib: _run(lib, config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdist.init_process_group("gloo")
        try:
            want = run("torch")
        finally:
            port = [free_port() if rank == 0 else None]
            tdist.broadcast_object_list(port, src=0)
            tdist.destroy_process_group()
        torchdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port[0]}", rank=rank,
                                     world_size=world_size)
        try:
            return want, run("torchdist")
        finally:
            torchdist.destroy_process_group()


# -- the tests ----------------------------------------------------------------------------------------------------

_cache: dict[str, tuple[list, list]] = {}


def _results(config: str) -> tuple[list, list]:
    """(torch's per-rank results, torchdist's): one spawn per config for the module."""
    if config not in _cache:
        results = run_ranks(_run_both, 4 if config == "errors" else world(config), args=(config,), timeout=120)
        _cache[config] = ([w for w, _ in results], [g for _, g in results])
    return _cache[config]


@pytest.fixture(scope="module", params=list(CONFIGS))
def runs(request):
    return (request.param, *_results(request.param))


def _assert_close(got: dict, want: dict, what: str, **tol) -> None:
    assert got.keys() == want.keys(), what
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m: f"{what}, {name}: {m}", **tol)


def test_sharded_parameters_like_torch(runs):
    """Same meshes (the user's dim order; flattened shard dims as one), placements, shapes and values."""
    config, want, got = runs
    reference = dict(make_model().named_parameters())
    for rank, (w, g) in enumerate(zip(want, got)):
        assert g["params"] == w["params"], f"rank {rank}"
        _assert_close(g["initial"], w["initial"], f"rank {rank} full_tensor", rtol=0, atol=0)
        _assert_close(g["initial"], reference, f"rank {rank} vs model", rtol=0, atol=0)
    names = CONFIGS[config][0]
    meshes = {mesh for _, _, _, mesh, *_ in got[0]["params"]}
    expected = {"flattened_shard": (("a_b",), (4,)), "hsdp_flattened_shard": (("rep", "a_b"), (2, 4))}
    assert meshes == {expected.get(config, (names, (2,) * len(names)))}, meshes
    placements = dict((n, p) for n, _, p, *_ in got[0]["params"])
    if config == "dp_tp_sharded":  # FSDP's rows taken within each TP block of l1's rows
        assert placements["l1.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
        assert placements["l2.weight"] == "(Shard(dim=0), Shard(dim=1))"
    if config == "tp_dp_sharded":  # TP's dim comes first: FSDP's rows are cut from TP's block, a plain Shard
        assert placements["l1.weight"] == "(Shard(dim=0), Shard(dim=0))"
    if config in ("hsdp", "hsdp_flattened_shard"):
        assert set(placements.values()) == {"(Replicate(), Shard(dim=0))"}
    if config == "hsdp_tp_sharded":
        assert placements["l1.weight"] == "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))", placements
    if config == "replicate_only_tp_sharded":  # DDP-style: nothing sharded by FSDP, TP's layout kept
        assert placements["l1.weight"] == "(Replicate(), Shard(dim=0))", placements
        assert placements["l2.bias"] == "(Replicate(), Replicate())", placements


def test_unsharded_parameters_and_gradients_like_torch(runs):
    """Forward sees DTensors on the full mesh with the original placements; gradients are laid out as the sharded
    parameters."""
    config, want, got = runs
    for rank, (w, g) in enumerate(zip(want, got)):
        for key in ("unsharded", "grads"):
            assert g[key] == w[key], f"rank {rank} {key}"
    names, _, layouts, _ = CONFIGS[config]
    for name, kind, placements, mesh, *_ in got[0]["unsharded"]:
        expected = layouts.get(f"l1.{name}", ("R",) * len(names))
        assert (kind, mesh) == ("DTensor", (names, (2,) * len(names))), name
        assert placements.count("Replicate()") == expected.count("R"), (name, placements)
    assert [g[:5] for g in got[0]["grads"]] == [p[:5] for p in got[0]["params"]]


def test_training_matches_torch_and_single_process(runs):
    config, want, got = runs
    losses, grads, reference = train_reference(config)
    for rank, (w, g) in enumerate(zip(want, got)):
        torch.testing.assert_close(g["losses"], w["losses"], rtol=1e-5, atol=1e-6, msg=f"rank {rank} losses")
        _assert_close(g["first_grads"], w["first_grads"], f"rank {rank} gradients vs torch", rtol=1e-5, atol=1e-6)
        _assert_close(g["first_grads"], grads, f"rank {rank} gradients vs single process", rtol=1e-4, atol=1e-6)
        _assert_close(g["trained"], w["trained"], f"rank {rank} vs torch", rtol=1e-5, atol=1e-6)
        _assert_close(g["trained"], reference, f"rank {rank} vs single process", rtol=1e-4, atol=1e-5)
    # every data-parallel chunk's loss was seen by some rank, as in the single process
    seen = sorted(round(loss, 5) for g in got for loss in g["losses"])
    copies = world(config) // dp_size(config)  # ranks that see the same chunk (the non-data-parallel dims)
    expected = sorted(round(loss, 5) for step in losses for loss in step for _ in range(copies))
    assert seen == pytest.approx(expected, rel=1e-4), (seen, expected)
    moved = [not torch.allclose(got[0]["trained"][n], p) for n, p in make_model().named_parameters()]
    assert all(moved), "every parameter should have been trained"


def test_validation_errors_like_torch():
    want, got = _results("errors")
    for rank, (w, g) in enumerate(zip(want, got)):
        for case in w:
            if case == "other_mesh":
                continue
            if case == "replicate_only_int_reshard":
                assert w[case] is None and g[case] is None, (w[case], g[case])
                continue
            assert w[case] is not None, f"torch accepted {case}"
            assert g[case] == w[case], f"rank {rank} {case}"
        # torch's check is an identity check too, but its DTensors may come back holding an equal mesh created
        # earlier (here: ``mesh``, used before), so torch's answer depends on history; the message is torch's
        assert g["other_mesh"] == ("ValueError", "Expected param's DTensor mesh to be the same mesh passed to "
                                                 "fully_shard, but got different mesh objects"), g["other_mesh"]


def test_dp_mesh_dims_needs_a_dim():
    from torch.distributed.fsdp import DataParallelMeshDims as TorchDims

    from torchdist.fsdp import DataParallelMeshDims

    with pytest.raises(ValueError) as want:
        TorchDims()
    with pytest.raises(ValueError, match=f"^{want.value}$"):
        DataParallelMeshDims()
    assert DataParallelMeshDims(shard=("a", "b")).shard_names == TorchDims(shard=("a", "b")).shard_names
    assert DataParallelMeshDims(replicate="r").replicate_names == ("r",) and DataParallelMeshDims("s").shard == "s"
