"""DeviceMesh: the same programs on torch.distributed (gloo) and on torchdist give the same observations.

Each ``_observe_*`` body runs under ``run_ranks`` once with ``lib="torch"`` (it
initializes gloo itself) and once with ``lib="torchdist"``; the tests compare
what every rank saw: group members, descriptions and names per dimension (names
are creation counters, so equal names mean the same ``new_group`` calls in the
same order), coordinates, local ranks, slices, reprs, and the type and text of
every error.
"""

from __future__ import annotations

import importlib
import os
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F

import torchdist as dist
from torchdist.device_mesh import DeviceMesh, init_device_mesh
from torchdist.device_mesh._layout import MeshLayout
from torchdist.testing import run_ranks

from ddp._common import LR, assert_close_states, build, full_batches, shard, state, train_reference


def _libs(lib: str):
    """(c10d module, device_mesh module) of ``lib``; torch's default group is gloo, made here."""
    if lib == "torch":
        import torch.distributed as tdist

        tdist.init_process_group("gloo")
        return tdist, importlib.import_module("torch.distributed.device_mesh")
    return dist, importlib.import_module("torchdist.device_mesh")


def _outcome(fn):
    """What ``fn()`` returned, or its error's type name and args."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - the error is the observation
        return (type(exc).__name__, exc.args)


def _groups(c10d, mesh):
    return [(c10d.get_process_group_ranks(g), g.group_desc, g.group_name) for g in mesh.get_all_groups()]


def _describe(c10d, mesh):
    return {
        "repr": repr(mesh), "mesh": _outcome(lambda: mesh.mesh.tolist()), "names": mesh.mesh_dim_names,
        "shape": mesh.shape, "ndim": mesh.ndim, "size": mesh.size(), "sizes": [mesh.size(d) for d in range(mesh.ndim)],
        "coordinate": mesh.get_coordinate(), "rank": mesh.get_rank(), "device_type": mesh.device_type,
        "groups": _outcome(lambda: _groups(c10d, mesh)),
        "local_ranks": _outcome(lambda: [mesh.get_local_rank(d) for d in range(mesh.ndim)]),
    }


def _finish(c10d, lib, out):
    if lib == "torch":
        c10d.destroy_process_group()
    return out


def _compare(body, world_size, *args, timeout=90):
    want = run_ranks(body, world_size, args=("torch", *args), timeout=timeout)
    got = run_ranks(body, world_size, args=("torchdist", *args), backend="tcp", timeout=timeout)
    for rank, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys()
        for key in w:
            assert g[key] == w[key], f"rank {rank}, {key}: torchdist {g[key]!r}, torch {w[key]!r}"
    return got


# -- the layout algebra against torch's, without processes ---------------------------------------
@pytest.mark.parametrize("shape", [(2, 3, 2), (4,), (2, 1, 2), (1, 3)])
def test_layout_views_match_torchs(shape):
    from itertools import combinations

    from torch.distributed._mesh_layout import _MeshLayout

    ours, theirs = MeshLayout.from_sizes_strides(shape), _MeshLayout.from_sizes_strides(shape)
    rank_map = torch.arange(100, 100 + len(torch.zeros(shape).flatten()), dtype=torch.int)
    for k in range(1, len(shape) + 1):
        for dims in combinations(range(len(shape)), k):
            sliced = MeshLayout(tuple(ours[d] for d in dims))
            sliced_torch = _MeshLayout([theirs[d] for d in dims])
            assert torch.equal(sliced.remap_to_tensor(rank_map), sliced_torch.remap_to_tensor(rank_map)), dims
            flat = MeshLayout((sliced.collapse(),))
            flat_torch = _MeshLayout([sliced_torch.collapse()])
            assert torch.equal(flat.remap_to_tensor(rank_map), flat_torch.remap_to_tensor(rank_map)), dims
            assert sliced.sizes == sliced_torch.top_level_sizes and sliced.is_sorted()
            assert sliced.repr_strides() == tuple(
                a.stride[0] if len(a.stride) == 1 else a.stride for a in sliced_torch
            ), dims
    assert not MeshLayout(tuple(reversed(ours.axes))).is_sorted() or len(shape) == 1 or 1 in shape
    assert not MeshLayout((((2, 2),), ((3, 1),))).is_orthogonal()  # positions {0,2} and {0,1,2} overlap


@pytest.mark.parametrize("shape, dim, sizes", [
    ((8,), 0, (2, 2, 2)), ((8,), 0, (4, 2)), ((2, 6), 1, (3, 2)), ((4, 3), 0, (2, 2)), ((12,), 0, (2, 3, 2)),
    ((2, 3, 2), 1, (3, 1)),
])
def test_unflattened_layouts_match_torchs(shape, dim, sizes):
    from torch.distributed._mesh_layout import _MeshLayout

    ours = MeshLayout.from_sizes_strides(shape).unflatten(dim, sizes)
    theirs = _MeshLayout.from_sizes_strides(shape)
    theirs = theirs.splice(dim, dim + 1, theirs[dim].composition(_MeshLayout.from_sizes_strides(sizes)))
    rank_map = torch.arange(100, 100 + len(torch.zeros(shape).flatten()), dtype=torch.int)
    assert ours.sizes == theirs.top_level_sizes
    for d in range(len(ours)):
        assert torch.equal(MeshLayout((ours[d],)).remap_to_tensor(rank_map),
                           _MeshLayout([theirs[d]]).remap_to_tensor(rank_map)), d


def test_a_split_that_does_not_divide_its_axis_is_refused():
    axis = MeshLayout.from_sizes_strides((2, 2, 2))
    strided = MeshLayout((axis[0] + axis[2],))  # positions 0, 1, 4, 5: dims 0 and 2 flattened
    assert strided.unflatten(0, (2, 2)).axes == (((2, 4),), ((2, 1),))
    # positions 0, 1, 4, 5, 8, 9 as 2x3: rows (0, 1, 4) and (5, 8, 9) are no (size, stride) modes
    with pytest.raises(ValueError, match="cannot walk"):
        MeshLayout((((3, 4), (2, 1)),)).unflatten(0, (2, 3))


# -- a 2x2 mesh at world 4 ----------------------------------------------------------------------
def _observe_2x2(rank, world, lib):
    c10d, dm = _libs(lib)
    mesh = dm.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {"mesh": _describe(c10d, mesh)}
    dp, tp = mesh["dp"], mesh["tp"]
    out["dp"], out["tp"] = _describe(c10d, dp), _describe(c10d, tp)
    out["dp_root_dim"] = dp._get_root_mesh_dim()
    out["by_name"] = [c10d.get_process_group_ranks(mesh.get_group(n)) for n in ("dp", "tp")]
    out["same"] = (mesh["dp", "tp"] is mesh, dp == mesh["dp"], hash(dp) == hash(mesh["dp"]), dp == tp, mesh == dp)
    out["dp_is_world"] = dp.get_group() is c10d.group.WORLD
    out["errors"] = [
        _outcome(lambda: mesh.get_group()),
        _outcome(lambda: mesh.get_local_rank()),
        _outcome(lambda: mesh.get_group("xx")),
        _outcome(lambda: mesh.get_group(5)),
        _outcome(lambda: mesh.size(5)),
        _outcome(lambda: mesh["xx"]),
        _outcome(lambda: mesh["tp", "dp"]),
        _outcome(lambda: dp["tp"]),
        _outcome(lambda: dm.init_device_mesh("cpu", (2, 2))["dim_0"]),
        _outcome(lambda: dm.init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "a"))),
        _outcome(lambda: dm.init_device_mesh("cpu", (2, 2), mesh_dim_names=("a",))),
        _outcome(lambda: dm.init_device_mesh("cpu", (2, 4))),
        _outcome(lambda: dm.init_device_mesh("cpu:0", (4,))),
        _outcome(lambda: dm.init_device_mesh("cpu", (2, 2), backend_override={5: "gloo"})),
        _outcome(lambda: dm.init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"),
                                             backend_override={0: "gloo", "a": "gloo"})),
        _outcome(lambda: dm.DeviceMesh("cpu", [0, 1], backend_override=())),
        _outcome(lambda: dm.DeviceMesh("cpu", [0, 1], _init_backend=False).get_group()),
        _outcome(lambda: dm.init_device_mesh("cpu", (4,))._flatten()),
    ]
    overridden = dm.init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"),
                                     backend_override={"b": "gloo", 0: ("gloo", None)})
    whole = dm.init_device_mesh("cpu", (4,), backend_override={0: "gloo"})  # a new group, not the default one
    out["overridden"] = (_groups(c10d, overridden), _groups(c10d, whole), whole.get_group() is c10d.group.WORLD)
    flat = mesh._flatten()
    out["flat"] = _describe(c10d, flat)
    out["flat_is_world"] = flat.get_group() is c10d.group.WORLD
    out["flat_again"] = (mesh._flatten() is flat, mesh._flatten("dp_tp") is flat, dp._flatten() is dp)
    out["flat_from_root"] = (_describe(c10d, mesh["dp_tp"]), c10d.get_process_group_ranks(mesh.get_group("dp_tp")))
    out["flat_errors"] = [_outcome(lambda: mesh._flatten("dp")), _outcome(lambda: dp._flatten("dp_tp")),
                          _outcome(lambda: dp["dp_tp"])]
    tp_flat = tp._flatten("tp2")
    out["tp_flat"] = (_describe(c10d, tp_flat), _describe(c10d, mesh["tp2"]))
    # a mesh given as a tensor, transposed: dimension "x" runs down the columns of [[0, 2], [1, 3]]
    out["tensor_mesh"] = _describe(c10d, dm.DeviceMesh("cpu", torch.tensor([[0, 2], [1, 3]]),
                                                       mesh_dim_names=("x", "y")))
    out["descending"] = _describe(c10d, dm.DeviceMesh("cpu", [3, 2, 1, 0]))
    out["submeshes"] = [m.mesh.tolist() for m in mesh._get_all_submeshes("tp")]
    return _finish(c10d, lib, out)


def test_2x2_mesh_matches_torch():
    got = _compare(_observe_2x2, 4)
    assert got[2]["mesh"]["coordinate"] == (1, 0) and got[2]["dp"]["mesh"] == ("ok", [0, 2])
    # names are creation counters: the dp groups came first, then the tp groups, as in torch
    assert got[2]["mesh"]["groups"] == ("ok", [([0, 2], "mesh_dp", "1"), ([2, 3], "mesh_tp", "4")])
    assert got[3]["mesh"]["repr"] == "DeviceMesh((dp=2, tp=2), 'cpu', stride=(2, 1))"


# -- sub-world meshes, non-members, from_group, a 3-D mesh ---------------------------------------------
def _observe_partial(rank, world, lib):
    c10d, dm = _libs(lib)
    out = {}
    part = dm.DeviceMesh("cpu", list(range(min(world, 2))))
    out["part"] = _describe(c10d, part)
    out["part_group"] = _outcome(lambda: part.get_group().group_desc)
    out["world"] = _describe(c10d, dm.init_device_mesh("cpu", (world,), mesh_dim_names=("w",)))
    out["from_world"] = _describe(c10d, dm.DeviceMesh.from_group(c10d.group.WORLD, "cpu"))
    out["from_errors"] = [
        _outcome(lambda: repr(dm.DeviceMesh.from_group(c10d.group.WORLD, "cpu", mesh=[0]))),
        _outcome(lambda: dm.DeviceMesh.from_group([], "cpu", mesh=[0], mesh_dim_names=("a",))),
        _outcome(lambda: dm.DeviceMesh.from_group([c10d.group.WORLD], "cpu")),
        _outcome(lambda: dm.DeviceMesh.from_group([c10d.group.WORLD], "cpu", mesh=[0])),
        _outcome(lambda: dm.DeviceMesh.from_group([c10d.group.WORLD], "cpu", mesh=[[0]], mesh_dim_names=("a",))),
    ]
    if world >= 2:
        pair = c10d.new_group([0, 1])
        if rank < 2:
            from_pair = dm.DeviceMesh.from_group(pair, "cpu", mesh=torch.tensor([0, 1]), mesh_dim_names=("p",))
            out["from_pair"] = (_describe(c10d, from_pair), from_pair.get_group() is pair)
    if world == 4:
        m3 = dm.init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("a", "b", "c"))
        out["m3"] = _describe(c10d, m3)
        out["m3_ac"] = _describe(c10d, m3["a", "c"])
        out["m3_ab"] = _describe(c10d, m3["a", "b"])
        flat_ac = m3["a", "c"]._flatten()
        out["m3_ac_flat"] = (_describe(c10d, flat_ac), _outcome(lambda: _describe(c10d, m3["a_c", "b"])))
        out["m3_errors"] = [_outcome(lambda: m3["c", "a"]), _outcome(lambda: m3["a", "b"]["a_c"])]
        grid = [m3.get_group(n) for n in ("a", "c")]
        out["m3_from_groups"] = _describe(c10d, dm.DeviceMesh.from_group(
            grid, "cpu", mesh=m3["a", "c"].mesh, mesh_dim_names=("a", "c")))
    return _finish(c10d, lib, out)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_partial_meshes_outsiders_and_from_group_match_torch(world_size):
    got = _compare(_observe_partial, world_size)
    if world_size >= 3:  # rank 2 is outside [0, 1]: no coordinate, and (as in torch) no group
        assert got[2]["part"]["coordinate"] is None and got[2]["part_group"][0] == "IndexError"
    if world_size == 4:
        assert [g[:2] for g in got[3]["m3_ac"]["groups"][1]] == [([1, 3], "mesh_a"), ([2, 3], "mesh_c")]


# -- _unflatten: one dimension split into several ----------------------------------------------------
def _observe_unflatten(rank, world, lib):
    c10d, dm = _libs(lib)
    out = {}
    line = dm.init_device_mesh("cpu", (world,), mesh_dim_names=("w",))
    whole = line._unflatten(0, (1, world), ("one", "all"))
    out["whole"] = (_describe(c10d, whole), whole.get_group("all") is c10d.group.WORLD)
    out["errors"] = [
        _outcome(lambda: line._unflatten(1, (world,), ("a",))),
        _outcome(lambda: line._unflatten("x", (world,), ("a",))),
        _outcome(lambda: line._unflatten(0, (world,), ("a", "b"))),
        _outcome(lambda: line._unflatten(0, (world, 2), ("a", "b"))),
    ]
    if world == 4:
        grid = line._unflatten("w", (2, 2), ("dp", "tp"))
        out["grid"] = [_describe(c10d, m) for m in (grid, grid["dp"], grid["tp"], grid["dp", "tp"])]
        out["grid_flat"] = _describe(c10d, grid._flatten("again"))
        square = dm.init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        out["square"] = _describe(c10d, square._unflatten("b", (2, 1), ("b0", "b1"), backend_override={"b0": "gloo"}))
        out["slice"] = _describe(c10d, square["a"]._unflatten(0, (2,), ("a2",)))
        out["flat"] = _describe(c10d, square._flatten()._unflatten(0, (2, 2), ("x", "y")))
    c10d.barrier()  # rank 0 holds torch's store: nobody leaves while a peer still creates groups
    return _finish(c10d, lib, out)


@pytest.mark.parametrize("world_size", [3, 4])
def test_unflatten_matches_torch(world_size):
    got = _compare(_observe_unflatten, world_size)
    if world_size == 4:
        assert got[1]["grid"][0]["coordinate"] == (0, 1) and got[1]["grid"][1]["mesh"] == ("ok", [1, 3])
        assert [e[0] for e in got[0]["errors"]] == ["ValueError", "ValueError", "RuntimeError", "ValueError"]


# -- torchdist only: communication over the mesh's groups ---------------------------------------------
def _collectives(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    sums = {}
    for name in ("dp", "tp"):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=mesh.get_group(name))
        sums[name] = t.item()
    flat = torch.tensor([float(rank + 1)])
    dist.all_reduce(flat, group=mesh._flatten().get_group())
    gathered = [torch.zeros(1) for _ in range(2)]
    dist.all_gather(gathered, torch.tensor([float(rank)]), group=mesh["dp"].get_group())
    with mesh as entered:
        from torchdist.device_mesh._mesh import _mesh_resources

        current = _mesh_resources.get_current_mesh() is entered
    # a pickled mesh finds its groups again by name, as torch's does
    copy = pickle.loads(pickle.dumps(mesh["dp"]))
    again = torch.ones(1)
    dist.all_reduce(again, group=copy.get_group())
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    detail = repr(mesh["tp"])
    return sums, flat.item(), [g.item() for g in gathered], current, (copy == mesh["dp"], again.item()), detail


def test_collectives_on_mesh_groups():
    for rank, (sums, flat, gathered, current, copied, detail) in enumerate(run_ranks(_collectives, 4, backend="tcp")):
        dp_peer, tp_peer = rank ^ 2, rank ^ 1  # [[0, 1], [2, 3]]: columns are dp groups, rows tp groups
        assert sums == {"dp": rank + dp_peer + 2, "tp": rank + tp_peer + 2}, (rank, sums)
        assert flat == 10 and gathered == sorted([rank, dp_peer]) and current and copied == (True, 2.0)
        assert detail == f"DeviceMesh((tp=2), 'cpu', stride=(1,), Mesh: {sorted([rank, tp_peer])})", detail


def _without_init(rank, world):
    mesh = init_device_mesh("cpu", (world,))  # initializes the default group from the environment
    return dist.is_initialized(), mesh.get_group() is dist.group.WORLD, dist.get_backend()


def test_init_device_mesh_initializes_the_default_group():
    for initialized, is_world, _ in run_ranks(_without_init, 2):
        assert initialized and is_world


def _accelerator(rank, world, device_type, launched):
    if not launched:
        del os.environ["LOCAL_RANK"]
    return _outcome(lambda: repr(init_device_mesh(device_type, (world,))))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a usable CUDA device")
def test_an_accelerator_torch_cannot_use_is_an_error_under_a_launcher():
    kind, args = run_ranks(_accelerator, 2, args=("cuda", True), backend="tcp")[0]
    assert kind == "RuntimeError" and "torch.cuda.is_available() is False" in args[0], args
    # without LOCAL_RANK and without devices nothing is selected: PyTorch accepts the mesh, and so does torchdist
    outcome = run_ranks(_accelerator, 2, args=("cuda", False), backend="tcp")[0]
    assert outcome == ("ok", "DeviceMesh((2,), 'cuda', stride=(1,))"), outcome


# -- DDP over a mesh ---------------------------------------------------------------------------------
STEPS = 3


def _ddp_on_mesh(rank, world, shape):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp")[:len(shape)])
    dp_mesh = mesh["dp"]
    dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
    model = dist.DistributedDataParallel(build("mlp"), device_mesh=dp_mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in full_batches("mlp", dp_size, STEPS):
        opt.zero_grad()
        F.cross_entropy(model(shard(x, dp_rank)), shard(y, dp_rank)).backward()
        opt.step()
    return state(model), dist.get_process_group_ranks(model.process_group)


@pytest.mark.parametrize("world_size,shape", [(2, (2,)), (4, (2, 2))])
def test_ddp_with_device_mesh_matches_single_process(world_size, shape):
    want = train_reference("mlp", shape[0], STEPS)
    for rank, (got, group) in enumerate(run_ranks(_ddp_on_mesh, world_size, args=(shape,), backend="tcp")):
        assert group == ([0, 1] if world_size == 2 else [rank % 2, rank % 2 + 2])
        assert_close_states(got, want)


def test_top_level_names_are_torchs():
    import torch.distributed as tdist

    assert dist.DeviceMesh is DeviceMesh and dist.init_device_mesh is init_device_mesh
    assert dist.device_mesh.__all__ == importlib.import_module("torch.distributed.device_mesh").__all__
    assert hasattr(tdist, "DeviceMesh") and hasattr(tdist, "init_device_mesh")
