"""``torchdist.tensor.debug`` against ``torch.distributed.tensor.debug``: the same programs under both libraries
on 1, 2 and 4 ranks (4 as a 2x2 mesh) give the same collective counts (total, per op, per module and phase), the
same tracing table at noise level 0, and ``visualize_sharding`` prints the same tables (PyTorch's need
``tabulate``; torchdist's are also checked against tables written out here).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import re

import pytest
import torch

from torchdist.testing import run_ranks

from ._common import Lib, compare

MESHES = [(1, (1,)), (2, (2,)), (4, (2, 2))]
TP_MESHES = [(1, (1,)), (2, (2,)), (4, (4,))]
_ANSI = re.compile(r"\x1B\[[0-?]*[ -/]*[@-~]")


def _debug(lib: Lib):
    return importlib.import_module(lib.T.__name__ + ".debug")


def _counts(mode) -> tuple[dict[str, int], int]:
    return {str(k): v for k, v in mode.get_comm_counts().items() if v}, mode.get_total_counts()


def _module_counts(mode) -> dict:
    return {fqn: {phase: {str(k): v for k, v in ops.items()} for phase, ops in phases.items()}
            for fqn, phases in mode.comm_module_counts.items()}


# -- counts of redistributions and ops -----------------------------------------------------------------------------


def _redistribution_counts(rank: int, world: int, lib_name: str, shape: tuple[int, ...]) -> dict:
    lib = Lib(lib_name, shape)
    T, S, R, P, mesh, nd = lib.T, lib.S, lib.R, lib.P, lib.mesh, lib.ndim
    CommDebugMode = _debug(lib).CommDebugMode
    out: dict = {}

    def count(name, fn):
        mode = CommDebugMode()
        with mode:
            fn()
        out[name] = _counts(mode)
        return mode

    torch.manual_seed(0)
    x = torch.randn(8, 6)
    s0 = T.distribute_tensor(x, mesh, [S(0)] * nd)
    uneven = T.distribute_tensor(torch.randn(7, 5), mesh, [S(1)] + [R()] * (nd - 1))
    partial = T.DTensor.from_local(x, mesh, [P()] * nd)
    count("Shard -> Replicate", lambda: s0.redistribute(mesh, [R()] * nd))
    count("uneven Shard -> Replicate", lambda: uneven.redistribute(mesh, [R()] * nd))
    count("Partial -> Replicate", lambda: partial.redistribute(mesh, [R()] * nd))
    count("Partial -> Shard", lambda: partial.redistribute(mesh, [S(0)] + [S(1)] * (nd - 1)))
    count("Partial -> nested Shard", lambda: partial.redistribute(mesh, [S(0)] * nd))
    count("Shard(0) -> Shard(1)", lambda: s0.redistribute(mesh, [S(1)] * nd))
    count("full_tensor", lambda: s0.full_tensor())
    replicated = T.distribute_tensor(x, mesh, [R()] * nd)
    count("Replicate -> Shard (local)", lambda: replicated.redistribute(mesh, [S(0)] * nd))
    if nd == 2:
        s0_r = T.distribute_tensor(x, mesh, [S(0), R()])
        count("(S0, R) -> (R, S1)", lambda: s0_r.redistribute(mesh, [R(), S(1)]))
        count("(P, S0) -> (S0, R)", lambda: T.DTensor.from_local(x, mesh, [P(), S(0)]).redistribute(
            mesh, [S(0), R()]))
    a = T.distribute_tensor(torch.randn(8, 8), mesh, [S(1)] + [R()] * (nd - 1))
    b = T.distribute_tensor(torch.randn(8, 4), mesh, [S(0)] + [R()] * (nd - 1))
    count("matmul S(1) @ S(0)", lambda: a @ b)
    count("matmul then full_tensor", lambda: (a @ b).full_tensor())
    rows = T.distribute_tensor(torch.randn(8, 8), mesh, [S(0)] * nd)
    count("matmul S(0) @ S(0)", lambda: (rows @ b).full_tensor())
    count("c10d all_reduce", lambda: lib.c10d.all_reduce(torch.ones(3)))
    count("nothing", lambda: x + 1)
    if world > 1:  # PyTorch scatters/broadcasts on one-rank mesh dimensions too, torchdist skips them
        count("distribute_tensor", lambda: T.distribute_tensor(x, mesh, [S(0)] + [R()] * (nd - 1)))
    # The key is torch.ops' packet: a PyTorch program's lookup works unchanged (the namespace exists once
    # torch.distributed._functional_collectives is imported, as torch.distributed.tensor does).
    mode = count("lookup", lambda: s0.full_tensor())
    importlib.import_module("torch.distributed._functional_collectives")  # registers torch.ops.c10d_functional

    out["lookup by packet"] = (mode.get_comm_counts()[torch.ops.c10d_functional.all_gather_into_tensor],
                               mode.get_comm_counts()[torch.ops.c10d_functional.all_reduce], repr(mode))
    lib.close()
    return out


@pytest.mark.parametrize("world,shape", MESHES)
def test_redistribution_counts_match_torch(world, shape):
    got = compare(_redistribution_counts, world, shape)
    if world > 1:
        assert got[0]["Shard -> Replicate"] == ({"c10d_functional.all_gather_into_tensor": len(shape)}, len(shape))


# -- a tensor-parallel MLP, per module -----------------------------------------------------------------------------


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = torch.nn.Linear(8, 16)
        self.relu = torch.nn.ReLU()
        self.net2 = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def _mlp_counts(rank: int, world: int, lib_name: str, shape: tuple[int, ...]) -> dict:
    lib = Lib(lib_name, shape)
    TP = importlib.import_module(lib.T.__name__ + ".parallel")
    CommDebugMode = _debug(lib).CommDebugMode
    torch.manual_seed(0)
    model = TP.parallelize_module(_MLP(), lib.mesh, {"net1": TP.ColwiseParallel(), "net2": TP.RowwiseParallel()})
    x = torch.randn(4, 8, requires_grad=True)
    mode = CommDebugMode()
    with mode:
        model(x).sum().backward()
    out = {
        "counts": _counts(mode),
        "module counts": _module_counts(mode),
        "sharding": {k: str(v) for k, v in mode.get_sharding_info().items()},
        "parameters": {k: sorted(v) for k, v in mode.get_parameter_info().items()},
        "table 0": mode.generate_comm_debug_tracing_table(noise_level=0),
        "grad": x.grad.tolist(),
    }
    # A second forward in a new mode: counts start again, module names are the same.
    with mode:
        model(x)
    out["second forward"] = (_counts(mode), _module_counts(mode))
    lib.close()
    return out


@pytest.mark.parametrize("world,shape", TP_MESHES)
def test_tensor_parallel_mlp_counts_match_torch(world, shape):
    got = compare(_mlp_counts, world, shape)
    if world > 1:
        assert got[0]["module counts"]["_MLP.net2"] == {
            "forward": {"c10d_functional.all_reduce": 1}, "backward": {}}
        assert got[0]["counts"] == ({"c10d_functional.all_reduce": 2}, 2)


# -- the reports (torchdist only: they list the aten ops each library runs, which differ) --------------------------


def _reports(rank: int, world: int, path: str) -> dict:
    lib = Lib("torchdist", (world,))
    TP = importlib.import_module("torchdist.tensor.parallel")
    from torchdist.tensor.debug import CommDebugMode

    torch.manual_seed(0)
    model = TP.parallelize_module(_MLP(), lib.mesh, {"net1": TP.ColwiseParallel(), "net2": TP.RowwiseParallel()})
    with CommDebugMode() as mode:
        model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    out = {level: mode.generate_comm_debug_tracing_table(noise_level=level) for level in range(4)}
    if rank == 0:
        mode.log_comm_debug_tracing_table_to_file(file_name=f"{path}/log.txt", noise_level=1)
        mode.generate_json_dump(file_name=f"{path}/log.json", noise_level=2)
    counts = mode.get_comm_counts()
    out["lookups"] = (counts["c10d_functional.all_reduce"], counts[torch.ops._c10d_functional.all_reduce],
                      "c10d_functional.all_reduce" in counts, counts.get("c10d.broadcast_", 0))
    return out


def test_tracing_table_and_json(tmp_path):
    out = run_ranks(_reports, 2, args=(str(tmp_path),), timeout=60)[0]
    assert out["lookups"] == (2, 2, True, 0)
    assert _ANSI.sub("", out[0]).splitlines()[:4] == ["Global", "  FORWARD PASS",
                                                      "    *c10d_functional.all_reduce: 1", "  BACKWARD PASS"]
    plain = _ANSI.sub("", out[1])
    assert "    *module type: class 'tensor.test_debug._MLP'" in plain
    assert "     *weight: (Shard(dim=0),)" in plain and "     *weight: (Shard(dim=1),)" in plain
    assert "aten.mm.default" in plain and "aten.detach.default" not in plain
    assert "aten.detach.default" in out[3] or "aten.t.default" in out[3]
    assert len(out[3]) >= len(out[2]) >= len(out[1]) >= len(out[0])
    assert (tmp_path / "log.txt").read_text() == plain
    dump = json.loads((tmp_path / "log.json").read_text())
    assert dump["fqn"] == "Global" and [c["fqn"] for c in dump["children"]] == ["_MLP"]
    mlp = dump["children"][0]
    assert [c["fqn"] for c in mlp["children"]] == ["_MLP.net1", "_MLP.relu", "_MLP.net2"]
    assert mlp["children"][2]["collectives_forward"] == [["c10d_functional.all_reduce", 1]]
    assert mlp["children"][0]["parameters"] == [["weight", "(Shard(dim=0),)"], ["bias", "(Shard(dim=0),)"]]


# -- visualize_sharding ------------------------------------------------------------------------------------------


def _layouts(lib: Lib):
    S, R, nd = lib.S, lib.R, lib.ndim
    yield "2-D S(0)", (8, 6), [S(0)] * nd
    yield "2-D S(1)", (8, 6), [S(1)] * nd
    yield "2-D R", (8, 6), [R()] * nd
    yield "1-D S(0)", (10,), [S(0)] * nd
    yield "1-D R", (10,), [R()] * nd
    yield "uneven", (3, 5), [S(0)] * nd
    if nd == 2:
        yield "2-D S(0),S(1)", (8, 6), [S(0), S(1)]
        yield "2-D S(1),S(0)", (8, 6), [S(1), S(0)]
        yield "2-D R,S(1)", (8, 6), [R(), S(1)]
        yield "2-D S(0),R", (8, 6), [S(0), R()]


def _visualize(rank: int, world: int, lib_name: str, shape: tuple[int, ...]) -> dict:
    lib = Lib(lib_name, shape)
    visualize_sharding = _debug(lib).visualize_sharding
    out = {}
    for name, tensor_shape, placements in _layouts(lib):
        dt = lib.T.distribute_tensor(torch.zeros(tensor_shape), lib.mesh, placements)
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            visualize_sharding(dt)
        out[name] = text.getvalue()
    lib.close()
    return out


@pytest.mark.parametrize("world,shape", MESHES)
def test_visualize_sharding_matches_torch(world, shape):
    pytest.importorskip("tabulate", reason="PyTorch's visualize_sharding needs tabulate")
    compare(_visualize, world, shape)


# Tables as PyTorch prints them on rank 0 of a 2x2 mesh (all other ranks print nothing).
EXPECTED_2X2 = {
    "2-D S(0),S(1)": """\
         Col 0-2    Col 3-5
-------  ---------  ---------
Row 0-3  cpu:0      cpu:1
Row 4-7  cpu:2      cpu:3
""",
    "2-D S(0)": """\
         Col 0-5
-------  ---------
Row 0-1  cpu:0
Row 2-3  cpu:1
Row 4-5  cpu:2
Row 6-7  cpu:3
""",
    "2-D R,S(1)": """\
         Col 0-2    Col 3-5
-------  ---------  ---------
Row 0-7  cpu:0,2    cpu:1,3
""",
    "1-D R": """\
         Col 0-0
-------  -----------
Row 0-9  cpu:0,1,2,3
""",
    "uneven": """\
         Col 0-4
-------  ---------
Row 0-0  cpu:0
Row 1-1  cpu:1
Row 2-2  cpu:2
Row 3-2  cpu:3
""",  # an empty shard: PyTorch prints its range as "Row 3-2"
}


def test_visualize_sharding_tables():
    out = run_ranks(_visualize, 4, args=("torchdist", (2, 2)), timeout=60)
    for name, table in EXPECTED_2X2.items():
        assert out[0][name] == table, f"{name}:\n{out[0][name]}"
    assert all(text == "" for rank_out in out[1:] for text in rank_out.values())


def test_reports_reach_only_active_modes():
    from torchdist._c10d import comm_report
    from torchdist.tensor.debug import CommDebugMode

    outer, inner = CommDebugMode(), CommDebugMode()
    with outer:
        with inner:
            with comm_report.functional_collective("c10d_functional.all_reduce"):
                comm_report.report_c10d("all_reduce")  # the c10d call carrying it: hidden
        comm_report.report_c10d("broadcast")
        comm_report.report_c10d("barrier")  # PyTorch's CommDebugMode does not count barriers
    with comm_report.functional_collective("c10d_functional.all_reduce"):
        pass
    assert not comm_report._listeners
    assert _counts(inner) == ({"c10d_functional.all_reduce": 1}, 1)
    assert _counts(outer) == ({"c10d_functional.all_reduce": 1, "c10d.broadcast_": 1}, 2)
    assert outer.get_comm_counts()["c10d.broadcast_"] == 1 and torch.ops.c10d.broadcast_ in outer.get_comm_counts()
    assert repr(outer) == "CommDebugMode(get_total_counts()=2)"
