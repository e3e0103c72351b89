"""``local_map`` and ``register_sharding`` (tensor.experimental) against torch.distributed.tensor.experimental.

Same program under both libraries on 1, 2 and 4 ranks (4 as a 2x2 mesh): same outputs, placements, local
blocks, gradients and errors; where an answer can be worked out without either library (the matmul of the docs'
example, gradients, softmax), it is checked against plain tensors as well.
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

from ._common import Lib, compare, observe

aten = torch.ops.aten
MESHES = [(1, (1,)), (2, (2,)), (4, (2, 2))]


def _experimental(lib: Lib):
    return importlib.import_module(lib.T.__name__ + ".experimental")


def _error_has(fn, *fragments: str):
    """The error type of ``fn()`` and whether its message holds every fragment (messages embed DTensor reprs,
    which differ between the libraries)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the error is the observation
        return type(exc).__name__, all(f in str(exc) for f in fragments)
    return "no error"


# -- local_map ---------------------------------------------------------------------------------------------------


def _local_map_forward(rank: int, world: int, lib_name: str, shape: tuple[int, ...]) -> dict:
    lib = Lib(lib_name, shape)
    X, T, S, R, mesh, nd = _experimental(lib), lib.T, lib.S, lib.R, lib.mesh, lib.ndim
    rest = [R()] * (nd - 1)
    out: dict = {}
    group = mesh.get_group(0)

    # The docs' example: W column-wise, X row-wise, a local mm and an all-reduce give the replicated product.
    def mm_allreduce_forward(w, x):
        partial_sum = torch.mm(w, x)
        lib.c10d.all_reduce(partial_sum, group=group)
        return partial_sum

    torch.manual_seed(0)
    w, x = torch.randn(12, 8), torch.randn(8, 16)
    col_wise, row_wise = [S(1)] + rest, [S(0)] + rest
    local_mm = X.local_map(mm_allreduce_forward, out_placements=[R()] * nd, in_placements=(col_wise, row_wise),
                           device_mesh=mesh)
    w_dt, x_dt = T.distribute_tensor(w, mesh, col_wise), T.distribute_tensor(x, mesh, row_wise)
    y = local_mm(w_dt, x_dt)
    out["docs example"] = observe(lambda: y)
    out["docs example value"] = torch.allclose(y.to_local(), w @ x, atol=1e-5)
    # Mismatched placements: PyTorch's ValueError, or a redistribution when asked.
    w_rows = T.distribute_tensor(w, mesh, row_wise)
    out["mismatch"] = _error_has(lambda: local_mm(w_rows, x_dt), "in local_map has a mismatched placements",
                                 f"but the input placements is {tuple(col_wise)}!",
                                 "set redistribute_inputs=True to local_map.")
    redistributing = X.local_map(mm_allreduce_forward, [R()] * nd, (col_wise, row_wise), device_mesh=mesh,
                                 redistribute_inputs=True)
    out["redistribute_inputs"] = observe(lambda: redistributing(w_rows, x_dt))
    out["arity"] = observe(lambda: local_mm(w_dt))
    # Decorator form, no device_mesh (the first DTensor's), several outputs, non-DTensor inputs and outputs.

    @X.local_map(out_placements=(row_wise, None, [R()] * nd), in_placements=(row_wise, None, [R()] * nd))
    def scaled(a, factor, plain):
        return a * factor + plain.sum(), factor + 1, plain * 2

    plain = torch.arange(3.0)
    out["decorator"] = observe(lambda: scaled(x_dt, 2.0, plain))
    out["plain tensor passed through"] = observe(lambda: scaled(x_dt, 2.0, plain)[2].to_local())
    out["no DTensor in"] = observe(lambda: scaled(x, 2.0, plain))
    out["non-tensor placements"] = observe(lambda: X.local_map(
        lambda a, f: a * f, [R()] * nd, ([R()] * nd, [R()] * nd))(x_dt, 2.0))
    out["DTensor without placements"] = observe(lambda: X.local_map(
        lambda a, f: a * f, [R()] * nd, (None, None))(x_dt, 2.0), message=False)
    out["output count"] = observe(lambda: X.local_map(lambda a: (a, a), [R()] * nd)(x_dt))
    out["non-tensor output placements"] = observe(lambda: X.local_map(lambda a: (a, 1), (row_wise, row_wise))(x_dt),
                                                  message=False)
    out["DTensor output"] = observe(lambda: X.local_map(lambda a: w_dt, [R()] * nd)(x_dt), message=False)
    # Placements follow the flattened arguments: a pair of DTensors takes two entries.
    out["nested args"] = observe(lambda: X.local_map(lambda ab: ab[0] + ab[1], row_wise, (row_wise, row_wise))(
        (x_dt, x_dt)))
    lib.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,shape", MESHES)
def test_local_map_matches_torch(world, shape):
    got = compare(_local_map_forward, world, shape)
    assert all(rank["docs example value"] is True for rank in got)
    assert all(rank["mismatch"] == ("ValueError", True) for rank in got)


def _local_map_backward(rank: int, world: int, lib_name: str, shape: tuple[int, ...]) -> dict:
    lib = Lib(lib_name, shape)
    X, T, S, R, P, mesh, nd = _experimental(lib), lib.T, lib.S, lib.R, lib.P, lib.mesh, lib.ndim
    rest = [R()] * (nd - 1)
    rows, rep = [S(0)] + rest, [R()] * nd
    out: dict = {}
    torch.manual_seed(1)
    a, b = torch.randn(8, 5), torch.randn(5, 3)

    def local_mm(x, w):
        return x @ w

    for name, grad_placements in (("default", None), ("hinted", (rows, [P()] + rest))):
        x = T.distribute_tensor(a, mesh, rows).requires_grad_(True)
        w = T.distribute_tensor(b, mesh, rep).requires_grad_(True)
        y = X.local_map(local_mm, rows, (rows, rep), grad_placements)(x, w)
        (y * y).sum().backward()
        out[f"{name} y"] = observe(lambda: y)
        out[f"{name} grads"] = observe(lambda: (x.grad, w.grad))
        out[f"{name} full w grad"] = observe(lambda: w.grad.full_tensor())
    # With the Partial hint the weight's gradient is the true one (each rank holds its rows' contribution).
    a_ref, b_ref = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    ((a_ref @ b_ref) ** 2).sum().backward()
    out["hinted w grad correct"] = torch.allclose(w.grad.full_tensor(), b_ref.grad, atol=1e-4)
    out["x grad correct"] = torch.allclose(x.grad.full_tensor(), a_ref.grad, atol=1e-4)
    lib.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,shape", MESHES)
def test_local_map_gradients_match_torch(world, shape):
    got = compare(_local_map_backward, world, shape)
    assert all(rank["hinted w grad correct"] and rank["x grad correct"] for rank in got)


# -- register_sharding -------------------------------------------------------------------------------------------


def _fallback_warnings(fn) -> tuple:
    """``fn()``'s result described, and how many "no sharding rule" (replicate-everything) warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = observe(fn)
    return result, sum("no sharding rule" in str(w.message) for w in caught)


def _register_sharding(rank: int, world: int, lib_name: str, shape: tuple[int, ...]) -> dict:
    lib = Lib(lib_name, shape)
    X, T, S, R, P, mesh, nd = _experimental(lib), lib.T, lib.S, lib.R, lib.P, lib.mesh, lib.ndim
    rest = [R()] * (nd - 1)
    out: dict = {}
    torch.manual_seed(2)
    a = torch.randn(8, 6)
    layouts = {"S0": [S(0)] + rest, "S1": [S(1)] + rest, "R": [R()] * nd, "S0S1": [S(0), S(1)][:nd]}
    before = {name: T.distribute_tensor(a, mesh, pl) for name, pl in layouts.items()}

    # The docs' example: softmax may keep any dim but its own sharded.
    @X.register_sharding(aten._softmax.default)
    def custom_softmax_sharding(x, dim, half_to_float):
        softmax_dim = dim if dim >= 0 else dim + x.ndim
        acceptable_shardings = [([R()], [R(), None, None])]
        for sharding_dim in range(x.ndim):
            if sharding_dim != softmax_dim:
                acceptable_shardings.append(([S(sharding_dim)], [S(sharding_dim), None, None]))
        return acceptable_shardings

    out["returns the function"] = custom_softmax_sharding.__name__
    for name, x in before.items():
        for dim in (0, 1, -1):
            y = torch.softmax(x, dim)
            out[f"softmax {name} dim {dim}"] = observe(lambda: y)
            out[f"softmax {name} dim {dim} correct"] = torch.allclose(y.full_tensor(), torch.softmax(a, dim))

    # An op with no torchdist rule (cumsum): the strategy is used, not the replicate-everything fallback.
    @X.register_sharding([aten.cumsum.default])
    def cumsum_sharding(x, dim, **kwargs):
        dim = dim % x.ndim
        return [([R()], [R(), None])] + [([S(d)], [S(d), None]) for d in range(x.ndim) if d != dim]

    for name, x in before.items():
        out[f"cumsum {name}"] = _fallback_warnings(lambda: torch.cumsum(x, 1))

    # Overriding a built-in rule: a row sum only on replicated input. (PyTorch caches its sharding decisions per
    # op, layout and shape and never forgets them, so the call before registering uses other shapes.)
    out["sum before"] = observe(lambda: T.distribute_tensor(torch.randn(4, 6), mesh, layouts["S0"]).sum(1))

    @X.register_sharding(aten.sum.dim_IntList)
    def replicated_sum(x, dim, keepdim=False, **kwargs):
        return [([R()], [R(), None, None])]

    out["sum after"] = observe(lambda: before["S0"].sum(1))
    # PyTorch's pick among free moves: the last strategy that moves nothing (R and Partial(max) agree on replicated
    # data), else the first that only cuts replicated inputs locally.
    X.register_sharding(aten.tril.default)(lambda x, diagonal=0: [([R()], [R(), None]), ([P("max")], [R(), None])])
    out["last unmoved"] = observe(lambda: torch.tril(before["R"]))
    out["last unmoved value"] = observe(lambda: torch.tril(before["R"]).full_tensor())
    X.register_sharding(aten.cumprod.default)(lambda x, dim, **kw: [([S(1)], [S(1), None]), ([S(0)], [S(0), None])])
    cube = T.distribute_tensor(torch.randn(4, 4, 6), mesh, [R()] * nd)
    out["first free"] = observe(lambda: torch.cumprod(cube, 2))
    # In-place ops may not move self; a strategy whose inputs do not match the call's is an error.
    X.register_sharding(aten.fill_.Scalar)(lambda self, value: [([R()], [R(), None])])
    out["in-place moving self"] = observe(lambda: T.distribute_tensor(a, mesh, layouts["S0"]).fill_(1.5))
    out["in-place keeping self"] = observe(lambda: T.distribute_tensor(a, mesh, layouts["R"]).fill_(1.5))
    X.register_sharding(aten.sum.default)(lambda x, **kwargs: [([R()], [R(), R()])])
    out["wrong input count"] = observe(lambda: before["R"].sum())
    lib.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,shape", MESHES)
def test_register_sharding_matches_torch(world, shape):
    got = compare(_register_sharding, world, shape)
    assert all(v is True for rank in got for k, v in rank.items() if k.endswith("correct"))
    assert all(rank[f"cumsum {name}"][1] == 0 for rank in got for name in ("S0", "S1", "R"))
    if world > 1:  # the override is visible: replicated where the built-in rule keeps rows sharded
        assert got[0]["sum before"][1][2][0] == "S(0)" and got[0]["sum after"][1][2][0] == "R"
    assert "max" in got[0]["last unmoved"][1][2][-1] and got[0]["first free"][1][2][-1] == "S(1)"


def test_exports_match_torch():
    import torch.distributed.tensor.experimental as theirs

    import torchdist.tensor.experimental as ours

    assert sorted(ours.__all__) == sorted(theirs.__all__)
    with pytest.raises(TypeError, match="OpOverload"):
        ours.register_sharding(aten.cumsum)
