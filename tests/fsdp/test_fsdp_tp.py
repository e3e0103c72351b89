"""2-D parallelism: ``fully_shard`` over ``parallelize_module`` (FSDP on "dp", tensor parallelism on "tp").

One spawn per mesh shape runs the same programs on torch's FSDP2 + TP (gloo) and then on torchdist's, in the same
processes, and returns what each saw: the sharded parameters' placements (``_StridedShard`` where TP and FSDP cut
the same dim), their gradients, the unsharded (TP) parameters, the state dict, and the full parameters after
training with SGD and Adam (foreach and single-tensor). The trained parameters are also compared with training
the unparallelized model in one process, and a ``torchdist.checkpoint`` round trip is checked. Sizes: even
(4 -> 8 -> 4) and uneven (5 -> 6 -> 5, hidden 2: TP blocks of 3 and 1 rows cut unevenly by FSDP, one rank
holding no row); TP itself needs the hidden size divisible by tp, in torch as here. With sequence parallelism
the LayerNorms' gradients come back Partial over "tp" and are all-reduced there before FSDP reduces them.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torchdist.testing import free_port

STEPS = 3
LOCAL_BATCH = 2
LR = 0.05
MICRO_BATCHES = 2

SEQUENCE = 4  # with sequence parallelism: inputs (batch, SEQUENCE, features), the sequence sharded over "tp"

#: name: (dp, tp, (model input, hidden sizes..., output), sequence parallel); dp a pair is HSDP (replicate, shard)
CONFIGS = {
    "dp2_tp2": (2, 2, (4, 8, 8, 3), False),
    "dp2_tp2_uneven": (2, 2, (5, 6, 2, 3), False),
    "dp2_tp2_sequence": (2, 2, (4, 8, 6, 3), True),
    "dp1_tp2": (1, 2, (4, 8, 6, 3), False),
    "dp2_tp1": (2, 1, (5, 6, 3, 3), False),
    "hsdp2x1_tp2": ((2, 1), 2, (4, 8, 6, 3), False),
}


def dp_size(config: str) -> int:
    dp = CONFIGS[config][0]
    return dp[0] * dp[1] if isinstance(dp, tuple) else dp
#: name: (optimizer, foreach, micro-batches, reshard_after_forward)
SCENARIOS = {
    "sgd": ("sgd", False, 1, True),
    "adam_foreach": ("adam", True, 1, True),
    "adamw_no_sync": ("adamw", False, MICRO_BATCHES, True),
    "sgd_foreach_keep": ("sgd", True, 1, False),
}


class FeedForward(nn.Module):
    """``up`` colwise, ``down`` rowwise: TP's usual pair (one all-reduce forward, one backward); a pre-norm with
    sequence parallelism."""

    def __init__(self, dim: int, hidden: int, sequence_parallel: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim) if sequence_parallel else nn.Identity()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.relu(self.up(self.norm(x))))


class Net(nn.Module):
    """Feed-forward blocks (tensor parallel), then a LayerNorm and a head that stay plain (FSDP only)."""

    def __init__(self, sizes: tuple[int, ...], sequence_parallel: bool = False) -> None:
        super().__init__()
        dim, *hidden, out = sizes
        self.blocks = nn.ModuleList([FeedForward(dim, h, sequence_parallel) for h in hidden])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_model(config: str, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net(CONFIGS[config][2], CONFIGS[config][3])


def batches(config: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``STEPS`` global batches; data-parallel rank ``d`` trains on chunk ``d`` (the TP ranks on the same one)."""
    _, _, sizes, sequence_parallel = CONFIGS[config]
    dp = dp_size(config)
    g = torch.Generator().manual_seed(1)
    n = LOCAL_BATCH * dp
    lead = (n, SEQUENCE) if sequence_parallel else (n,)
    return [(torch.randn(*lead, sizes[0], generator=g), torch.randn(*lead, sizes[-1], generator=g))
            for _ in range(STEPS)]


def make_optimizer(name: str, foreach: bool, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=LR, momentum=0.9, foreach=foreach)
    cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    return cls(params, lr=LR, foreach=foreach)


def train_reference(config: str, scenario: str) -> dict[str, torch.Tensor]:
    """The same training in one process on whole batches, the gradient of each data-parallel chunk (and
    micro-batch) scaled as FSDP averages it."""
    name, foreach, micro, _ = SCENARIOS[scenario]
    dp = dp_size(config)
    model = make_model(config)
    opt = make_optimizer(name, foreach, model.parameters())
    for x, y in batches(config):
        for xs, ys in zip(x.chunk(dp), y.chunk(dp)):
            for xm, ym in zip(xs.chunk(micro), ys.chunk(micro)):
                (F.mse_loss(model(xm), ym) / dp).backward()
        opt.step()
        opt.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# -- what runs on the ranks ---------------------------------------------------------------------------------------


def _libs(lib: str):
    """(fsdp module, tensor.parallel module, init_device_mesh) of torch or torchdist."""
    import importlib

    prefix = "torch.distributed" if lib == "torch" else "torchdist"
    return (importlib.import_module(f"{prefix}.fsdp"), importlib.import_module(f"{prefix}.tensor.parallel"),
            importlib.import_module(f"{prefix}.device_mesh").init_device_mesh)


def _tp_plan(parallel, sequence_parallel: bool) -> dict:
    """Colwise up, rowwise down; with sequence parallelism the norms and the residual stream are sharded on the
    sequence, and the input of the final norm is gathered."""
    if not sequence_parallel:
        return {"blocks.*.up": parallel.ColwiseParallel(), "blocks.*.down": parallel.RowwiseParallel()}
    from importlib import import_module

    shard, replicate = (getattr(import_module(parallel.__name__.rsplit(".", 1)[0]), name)
                        for name in ("Shard", "Replicate"))
    return {"blocks.*.norm": parallel.SequenceParallel(),
            "blocks.*.up": parallel.ColwiseParallel(input_layouts=shard(1)),
            "blocks.*.down": parallel.RowwiseParallel(output_layouts=shard(1)),
            "norm": parallel.PrepareModuleInput(input_layouts=shard(1), desired_input_layouts=replicate(),
                                                use_local_output=True)}


def _parallelize(lib: str, config: str, seed: int = 0, reshard_after_forward: bool = True) -> nn.Module:
    """TP on "tp", then FSDP on "dp" (HSDP on ("replicate", "shard")): each block, then the root."""
    dp, tp, _, sequence_parallel = CONFIGS[config]
    fsdp, parallel, init_device_mesh = _libs(lib)
    if isinstance(dp, tuple):
        mesh = init_device_mesh("cpu", (*dp, tp), mesh_dim_names=("replicate", "shard", "tp"))
        dp_mesh = mesh["replicate", "shard"]
    else:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        dp_mesh = mesh["dp"]
    model = make_model(config, seed)
    parallel.parallelize_module(model, mesh["tp"], _tp_plan(parallel, sequence_parallel))
    for block in model.blocks:
        fsdp.fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fsdp.fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    return model


def _local_batch(config: str, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's inputs (its data-parallel chunk; with sequence parallelism, its TP rank's part of the sequence)
    and targets (the whole sequence: the final norm gathers it)."""
    _, tp, _, sequence_parallel = CONFIGS[config]
    dp = dp_size(config)
    dp_rank, tp_rank = divmod(rank, tp)  # init_device_mesh lays ranks out row-major: (dp, tp)
    x, y = (t.chunk(dp)[dp_rank] for t in batches(config)[step])
    return (x.chunk(tp, dim=1)[tp_rank] if sequence_parallel else x), y


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor().detach().clone() if hasattr(tensor, "full_tensor") else tensor.detach().clone()


def _layout(tensor: torch.Tensor) -> tuple:
    """Type, placements, mesh names and shape, global and local shape: what the user can see of a (D)Tensor."""
    mesh = getattr(tensor, "device_mesh", None)
    return (type(tensor).__name__, str(getattr(tensor, "placements", None)),
            None if mesh is None else (mesh.mesh_dim_names, tuple(mesh.shape)), tuple(tensor.shape),
            tuple(tensor.to_local().shape) if hasattr(tensor, "to_local") else None)


def _observe(lib: str, config: str, rank: int) -> dict:
    """Layouts of the sharded parameters, the state dict, the gradients and the unsharded parameters."""
    model = _parallelize(lib, config)
    seen = {"params": [(n, *_layout(p), p.requires_grad) for n, p in model.named_parameters()],
            "state_dict": [(k, *_layout(v)) for k, v in model.state_dict().items()],
            "full": {n: _full(p) for n, p in model.named_parameters()}}
    x, y = _local_batch(config, rank, 0)
    F.mse_loss(model(x), y).backward()
    seen["grads"] = [(n, *_layout(p.grad), p.grad.stride()) for n, p in model.named_parameters()]
    seen["after_backward"] = [(n, *_layout(p)) for n, p in model.named_parameters()]
    block = model.blocks[0]
    block.unshard()
    seen["unsharded"] = [(n, *_layout(p)) for n, p in block.named_parameters()]
    block.reshard()
    seen["resharded"] = [(n, *_layout(p)) for n, p in block.named_parameters()]
    return seen


def _train(lib: str, config: str, rank: int, scenario: str) -> dict[str, torch.Tensor]:
    name, foreach, micro, reshard = SCENARIOS[scenario]
    model = _parallelize(lib, config, reshard_after_forward=reshard)
    opt = make_optimizer(name, foreach, model.parameters())
    for step in range(STEPS):
        xs, ys = _local_batch(config, rank, step)
        for i, (xm, ym) in enumerate(zip(xs.chunk(micro), ys.chunk(micro))):
            last = i == micro - 1
            model.set_requires_gradient_sync(last)
            F.mse_loss(model(xm), ym).backward()
            if not last:  # without sync nothing is reduced yet
                assert all(p.grad is None for p in model.parameters())
        opt.step()
        opt.zero_grad()
    return {n: _full(v) for n, v in model.state_dict().items()}


def _checkpoint_round_trip(config: str, rank: int, path: str) -> dict:
    """torchdist only: save a trained 2-D model with torchdist.checkpoint, load it into a fresh one (other seed)."""
    import torchdist.checkpoint as dcp

    model = _parallelize("torchdist", config)
    opt = make_optimizer("adam", True, model.parameters())
    for step in range(2):
        x, y = _local_batch(config, rank, step)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    dcp.save(model.state_dict(), checkpoint_id=path)
    fresh = _parallelize("torchdist", config, seed=7)
    before = {n: _full(p) for n, p in fresh.named_parameters()}
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state)
    x, _ = _local_batch(config, rank, 2)
    with torch.no_grad():
        outputs = (model(x), fresh(x))
    return {"saved": {n: _full(p) for n, p in model.named_parameters()}, "before": before,
            "loaded": {n: _full(p) for n, p in fresh.named_parameters()},
            "placements": [(n, str(p.placements)) for n, p in fresh.named_parameters()], "outputs": outputs}


def _strided_ops(rank: int) -> dict:
    """torchdist only, world 4: DTensors laid out as FSDP + TP lays out parameters, ``(_StridedShard(0, sf=2),
    Shard(0))`` on a (2, 2) mesh, for even and uneven row counts: conversions and ops, as full tensors."""
    from torchdist.device_mesh import init_device_mesh
    from torchdist.tensor import DTensor, Replicate, Shard
    from torchdist.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh.get_coordinate()
    strided = (_StridedShard(0, split_factor=2), Shard(0))
    seen = {}
    for rows in (8, 7, 5, 3):
        full = torch.arange(rows * 3, dtype=torch.float32).view(rows, 3)
        local = full.chunk(2)[tp_rank].clone()  # TP's block, then FSDP's chunk of it (empty chunks included)
        local = list(local.tensor_split([-(-local.size(0) // 2)]))[dp_rank].clone()
        d = DTensor.from_local(local, mesh, strided, shape=full.shape, stride=full.stride())
        other = DTensor.from_local(full.clone(), mesh, (Replicate(), Replicate()))
        seen[rows] = {
            "full": d.full_tensor(),
            **{str(p): d.redistribute(mesh, p).full_tensor() for p in ((Replicate(), Shard(0)), (Shard(0), Shard(1)),
                                                                       (Shard(1), Replicate()))},
            "back": torch.equal(other.redistribute(mesh, strided).to_local(), local),
            "pointwise": (d * 2 + 1).full_tensor(), "pointwise_placements": (d * 2).placements == strided,
            "sum": d.sum().full_tensor(),  # not element by element: through the strided dims replicated
            "matmul": (d @ other.t()).full_tensor(),
            "inplace": d.add_(other).full_tensor(), "inplace_placements": d.placements == strided,
        }
    return seen


def _run(lib: str, config: str, rank: int) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = {"observe": _observe(lib, config, rank)}
        for scenario in SCENARIOS:
            got[scenario] = _train(lib, config, rank, scenario)
    return got


def _run_both(rank: int, world_size: int, config: str, path: str) -> tuple[dict, dict]:
    """torch's observations, then torchdist's (and its checkpoint round trip), in the same processes."""
    import torch.distributed as tdist

    import torchdist

    tdist.init_process_group("gloo")
    want = _run("torch", config, rank)
    port = [free_port() if rank == 0 else None]
    tdist.broadcast_object_list(port, src=0)
    tdist.destroy_process_group()
    torchdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port[0]}", rank=rank, world_size=world_size)
    try:
        got = _run("torchdist", config, rank)
        got["checkpoint"] = _checkpoint_round_trip(config, rank, path)
        if config == "dp2_tp2":
            got["strided"] = _strided_ops(rank)
        return want, got
    finally:
        torchdist.destroy_process_group()


# -- the tests ----------------------------------------------------------------------------------------------------

_cache: dict[str, tuple[list, list]] = {}


def _results(config: str, tmp_path_factory) -> tuple[str, list, list]:
    """(config name, torch's per-rank observations, torchdist's): one spawn per mesh shape for the module."""
    if config not in _cache:
        from torchdist.testing import run_ranks

        path = str(tmp_path_factory.mktemp(f"dcp_{config}"))
        results = run_ranks(_run_both, dp_size(config) * CONFIGS[config][1], args=(config, path), timeout=110)
        _cache[config] = ([w for w, _ in results], [g for _, g in results])
    return (config, *_cache[config])


@pytest.fixture(scope="module", params=list(CONFIGS))
def runs(request, tmp_path_factory):
    return _results(request.param, tmp_path_factory)


def _assert_close(got: dict, want: dict, what: str, **tol) -> None:
    assert got.keys() == want.keys(), what
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m: f"{what}, {name}: {m}", **tol)


def test_sharded_parameters_and_state_dict_like_torch(runs):
    config, want, got = runs
    tp = CONFIGS[config][1]
    for rank, (w, g) in enumerate(zip(want, got)):
        for key in ("params", "state_dict"):
            assert g["observe"][key] == w["observe"][key], f"rank {rank} {key}"
        _assert_close(g["observe"]["full"], w["observe"]["full"], f"rank {rank} full_tensor", rtol=0, atol=0)
        _assert_close(g["observe"]["full"], dict(make_model(config).named_parameters()), f"rank {rank} vs model",
                      rtol=0, atol=0)
    placements = {p[2] for p in got[0]["observe"]["params"]}
    if tp > 1:  # TP and FSDP both cut dim 0 of the colwise parameters: strided, on the 2-D mesh
        assert any(p.endswith(f"_StridedShard(dim=0, sf={tp}), Shard(dim=0))") for p in placements), placements
        assert any(p.endswith("Shard(dim=0), Shard(dim=1))") for p in placements), placements


def test_gradients_unsharded_and_resharded_parameters_like_torch(runs):
    config, want, got = runs
    for rank, (w, g) in enumerate(zip(want, got)):
        for key in ("grads", "after_backward", "unsharded", "resharded"):
            assert g["observe"][key] == w["observe"][key], f"rank {rank} {key}"
    unsharded = dict((n, rest) for n, *rest in got[0]["observe"]["unsharded"])
    if CONFIGS[config][1] > 1:  # the forward sees TP's DTensors on the 1-D "tp" mesh
        assert unsharded["up.weight"][:3] == ["DTensor", "(Shard(dim=0),)", (("tp",), (CONFIGS[config][1],))]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_training_matches_torch_and_single_process(runs, scenario):
    config, want, got = runs
    reference = train_reference(config, scenario)
    for rank, (w, g) in enumerate(zip(want, got)):
        _assert_close(g[scenario], w[scenario], f"{scenario} rank {rank} vs torch", rtol=1e-5, atol=1e-6)
        _assert_close(g[scenario], reference, f"{scenario} rank {rank} vs single process", rtol=1e-4, atol=1e-5)
    moved = [not torch.allclose(got[0][scenario][n], p) for n, p in make_model(config).named_parameters()]
    assert all(moved), "every parameter should have been trained"


def test_checkpoint_round_trip_restores_parameters(runs):
    config, _, got = runs
    for rank, g in enumerate(got):
        ckpt = g["checkpoint"]
        assert any(not torch.equal(ckpt["before"][n], ckpt["saved"][n]) for n in ckpt["saved"]), "nothing to load"
        _assert_close(ckpt["loaded"], ckpt["saved"], f"rank {rank} loaded", rtol=0, atol=0)
        torch.testing.assert_close(*ckpt["outputs"], rtol=0, atol=0)
        assert ckpt["placements"] == [(n, p) for n, _, p, *_ in g["observe"]["params"]]


def test_strided_shard_dtensor_conversions_and_ops(tmp_path_factory):
    _, _, got = _results("dp2_tp2", tmp_path_factory)
    for rank, g in enumerate(got):
        for rows, seen in g["strided"].items():
            full = torch.arange(rows * 3, dtype=torch.float32).view(rows, 3)
            for key in ("full", "(Replicate(), Shard(dim=0))", "(Shard(dim=0), Shard(dim=1))",
                        "(Shard(dim=1), Replicate())"):
                torch.testing.assert_close(seen[key], full, rtol=0, atol=0, msg=lambda m: f"{rank} {rows} {key} {m}")
            assert seen["back"] and seen["pointwise_placements"] and seen["inplace_placements"], (rank, rows)
            torch.testing.assert_close(seen["pointwise"], full * 2 + 1, rtol=0, atol=0)
            torch.testing.assert_close(seen["sum"], full.sum(), rtol=0, atol=0)
            torch.testing.assert_close(seen["matmul"], full @ full.t(), rtol=0, atol=0)
            torch.testing.assert_close(seen["inplace"], full * 2, rtol=0, atol=0)


def test_strided_shard_placement_like_torch():
    """Name, fields, repr, equality and the rows each rank holds, as torch's ``_StridedShard``."""
    import pickle

    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import Shard as TorchShard
    from torch.distributed.tensor.placement_types import _StridedShard as TorchStrided

    from torchdist.tensor._spec import compute_local_shape_and_global_offset
    from torchdist.tensor.placement_types import Shard, _StridedShard

    ours, theirs = _StridedShard(1, split_factor=3), TorchStrided(1, split_factor=3)
    assert (repr(ours), str(ours), ours.dim, ours.split_factor, ours.is_shard()) == \
        (repr(theirs), str(theirs), theirs.dim, theirs.split_factor, theirs.is_shard())
    assert ours == _StridedShard(1, sf=3) != Shard(1) and Shard(1) != ours and ours != _StridedShard(1, sf=2)
    assert pickle.loads(pickle.dumps(ours)) == ours and hash(ours) == hash(_StridedShard(1, sf=3))

    class Mesh:  # what compute_local_shape_and_global_offset asks of a mesh, given a coordinate
        def __init__(self, shape):
            self.shape = shape

        def size(self, dim):
            return self.shape[dim]

    for rows in range(0, 11):
        for dp, tp in ((2, 2), (2, 3), (3, 2), (4, 2), (2, 4)):
            placements = (_StridedShard(0, split_factor=tp), Shard(0))
            torch_placements = [TorchStrided(0, split_factor=tp), TorchShard(0)]
            for coordinate in ((i, j) for i in range(dp) for j in range(tp)):
                assert compute_local_shape_and_global_offset((rows, 2), Mesh((dp, tp)), placements, coordinate) == \
                    _compute_local_shape_and_global_offset((rows, 2), (dp, tp), list(coordinate), torch_placements)
            tensor = torch.arange(rows * 2).view(rows, 2)
            got, got_pads = placements[0]._split_tensor(tensor, dp)
            want, want_pads = torch_placements[0]._split_tensor(tensor, dp)
            assert got_pads == want_pads and all(torch.equal(a, b) for a, b in zip(got, want))
