"""The differentiable collectives of ``torchdist.nn.functional``: forward values and gradients.

One program (``_program``) runs every function with inputs and loss weights that
are functions of the rank, and returns what each produced: outputs and input
gradients. It is run three ways: on torchdist, checked against sums computed
locally from PyTorch's backward definitions (``_expected``); and on torchdist and
torch.distributed (gloo, ``torch.distributed.nn.functional``) in the same ranks,
checked for equality. Values are small integers in float64, so every sum is exact
whatever order a backend adds in.
"""

import functools
import warnings

import pytest
import torch

import torchdist as dist
import torchdist.nn
import torchdist.nn.functional as F
from torchdist.testing import free_port, run_ranks

BACKENDS = ["tcp", "gloo"]  # "gloo": torchdist's default backend, under the name unmodified scripts pass
N = 3  # elements per tensor


def _x(key: int, n: int = N) -> torch.Tensor:
    """An input, different for every key."""
    return torch.arange(n, dtype=torch.float64) * (key % 5 + 1) + key % 7 - 3


def _w(key: int, n: int = N) -> torch.Tensor:
    """A loss weight (the gradient of the output it multiplies), different for every key."""
    return torch.arange(n, dtype=torch.float64) * 2 - (key % 4) - 1


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_(True)


def _program(rank, world, fn, red_ops, on_gloo=False):
    """Every function of ``fn`` (a functional module), once per root where there is one.

    ``on_gloo``: what torch.distributed's gloo can run: no AVG, and all_to_all with
    one size (its all_to_all is a scatter per rank, which wants equal pieces).

    Returns {case: [tensors]}: the forward results, then the input gradients.
    """
    got = {}
    ops = {"SUM": red_ops.SUM, "MAX": red_ops.MAX, "MIN": red_ops.MIN, "PRODUCT": red_ops.PRODUCT}
    if not on_gloo:
        ops["AVG"] = red_ops.AVG
    for name, op in ops.items():
        x = _leaf(_x(rank))
        y = fn.all_reduce(x, op=op)
        (y * _w(rank)).sum().backward()
        got[f"all_reduce {name}"] = [y.detach(), x.grad]
    # a non-contiguous input: the output is a new, contiguous tensor
    base = _leaf(_x(rank, 2 * N).reshape(2, N))
    y = fn.all_reduce(base.t())
    (y * _w(rank, 2 * N).reshape(N, 2)).sum().backward()
    got["all_reduce strided"] = [y.detach(), torch.tensor(y.is_contiguous()), base.grad]
    for root in range(world):
        x = _leaf(_x(rank))
        y = fn.broadcast(x, src=root)
        (y * _w(rank)).sum().backward()
        got[f"broadcast {root}"] = [y.detach(), x.grad]

        x = _leaf(_x(rank))
        y = fn.reduce(x, root)
        (y * _w(rank)).sum().backward()
        got[f"reduce {root}"] = [y.detach() if rank == root else None, x.grad]  # non-roots: whatever the backend left

        x = _leaf(_x(rank))
        ys = fn.gather(x, dst=root)
        sum((y * _w(10 * rank + i)).sum() for i, y in enumerate(ys)).backward()
        got[f"gather {root}"] = [*(y.detach() for y in ys), x.grad]

        xs = [_leaf(_x(10 * rank + j)) for j in range(world)]
        y = fn.scatter(xs, src=root)
        (y * _w(rank)).sum().backward()
        got[f"scatter {root}"] = [y.detach(), *(x.grad for x in xs)]

    x = _leaf(_x(rank))
    ys = fn.all_gather(x)
    sum((y * _w(10 * rank + i)).sum() for i, y in enumerate(ys)).backward()
    got["all_gather"] = [*(y.detach() for y in ys), x.grad]

    xs = [_leaf(_x(rank * world + j)) for j in range(world)]
    out = torch.full((N,), -1.0, dtype=torch.float64)
    y = fn.reduce_scatter(out, xs)
    (y * _w(rank)).sum().backward()
    got["reduce_scatter"] = [y.detach(), out.detach(), *(x.grad for x in xs)]

    # uneven all_to_all: rank r sends j + 1 elements to rank j, so receives r + 1 from each
    size = (lambda r: N) if on_gloo else (lambda r: r + 1)
    xs = [_leaf(_x(100 * rank + j, size(j))) for j in range(world)]
    outs = [torch.empty(size(rank), dtype=torch.float64) for _ in range(world)]
    ys = fn.all_to_all(outs, xs)
    sum((y * _w(10 * rank + i, size(rank))).sum() for i, y in enumerate(ys)).backward()
    got["all_to_all"] = [*(y.detach() for y in ys), *(o.detach() for o in outs), *(x.grad for x in xs)]

    x = _leaf(torch.cat([_x(100 * rank + j, j + 1) for j in range(world)]))
    out = torch.empty(world * (rank + 1), dtype=torch.float64)
    y = fn.all_to_all_single(out, x, output_split_sizes=[rank + 1] * world,
                             input_split_sizes=[j + 1 for j in range(world)])
    (y * torch.cat([_w(10 * rank + i, rank + 1) for i in range(world)])).sum().backward()
    got["all_to_all_single"] = [y.detach(), out.detach(), x.grad]

    x = _leaf(_x(rank, world * 2).reshape(world, 2))
    y = fn.all_to_all_single(torch.empty(world, 2, dtype=torch.float64), x)  # even splits
    (y * _w(rank, 2 * world).reshape(world, 2)).sum().backward()
    got["all_to_all_single even"] = [y.detach(), x.grad]
    return got


def _sum(ts):
    return functools.reduce(torch.add, ts)


def _expected(world):
    """What ``_program`` must return on each rank, from PyTorch's backward definitions, computed locally."""
    want = [{} for _ in range(world)]
    xs = [_x(r) for r in range(world)]
    ws = [_w(r) for r in range(world)]
    folds = {"SUM": torch.add, "MAX": torch.maximum, "MIN": torch.minimum, "PRODUCT": torch.mul}
    for name, fold in folds.items():
        for r in range(world):
            # backward: the same op over the ranks' gradients (right for SUM and AVG only)
            want[r][f"all_reduce {name}"] = [functools.reduce(fold, xs), functools.reduce(fold, ws)]
    for r in range(world):
        want[r]["all_reduce AVG"] = [_sum(xs) / world, _sum(ws) / world]
        want[r]["all_reduce strided"] = [_sum(_x(q, 2 * N).reshape(2, N).t() for q in range(world)),
                                         torch.tensor(True),
                                         _sum(_w(q, 2 * N).reshape(N, 2) for q in range(world)).t()]
    for root in range(world):
        for r in range(world):
            want[r][f"broadcast {root}"] = [xs[root], _sum(ws) if r == root else torch.zeros(N, dtype=torch.float64)]
            want[r][f"reduce {root}"] = [_sum(xs) if r == root else None, ws[root]]  # root's gradient, everywhere
            if r == root:
                gathered = xs
            else:
                gathered = [torch.zeros(N, dtype=torch.float64)] * world
            want[r][f"gather {root}"] = [*gathered, _w(10 * root + r)]  # the root's weight for my entry
            grads = [ws[j] if r == root else torch.zeros(N, dtype=torch.float64) for j in range(world)]
            want[r][f"scatter {root}"] = [_x(10 * root + r), *grads]
    for r in range(world):
        want[r]["all_gather"] = [*xs, _sum(_w(10 * q + r) for q in range(world))]
        reduced = _sum(_x(q * world + r) for q in range(world))
        want[r]["reduce_scatter"] = [reduced, reduced, *ws]
        received = [_x(100 * q + r, r + 1) for q in range(world)]
        want[r]["all_to_all"] = [*received, *received, *(_w(10 * j + r, j + 1) for j in range(world))]
        want[r]["all_to_all_single"] = [torch.cat(received), torch.cat(received),
                                        torch.cat([_w(10 * j + r, j + 1) for j in range(world)])]
        want[r]["all_to_all_single even"] = [
            torch.stack([_x(q, 2 * world).reshape(world, 2)[r] for q in range(world)]),
            torch.stack([_w(q, 2 * world).reshape(world, 2)[r] for q in range(world)])]
    return want


def _torchdist_program(rank, world):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return _program(rank, world, F, dist.ReduceOp)


def _mismatches(got: dict, want: dict, label: str) -> list[str]:
    wrong = []
    assert got.keys() == want.keys(), (label, sorted(got.keys() ^ want.keys()))
    for case in want:
        if len(got[case]) != len(want[case]):
            wrong.append(f"{label} {case}: {len(got[case])} tensors, want {len(want[case])}")
            continue
        for i, (g, w) in enumerate(zip(got[case], want[case])):
            if (g is None) != (w is None) or (w is not None and (g.dtype != w.dtype or not torch.equal(g, w))):
                wrong.append(f"{label} {case}[{i}]: got {g if g is None else g.tolist()}, "
                             f"want {w if w is None else w.tolist()}")
    return wrong


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_values_and_gradients_follow_pytorchs_definitions(world_size, backend):
    results = run_ranks(_torchdist_program, world_size, backend=backend, timeout=90)
    wrong = [w for rank, (got, want) in enumerate(zip(results, _expected(world_size)))
             for w in _mismatches(got, want, f"rank {rank}")]
    assert not wrong, "\n".join(wrong)


def _beside_torch(rank, world):
    """``_program`` on torch.distributed (gloo) and on torchdist, in the same ranks."""
    import torch.distributed as torch_dist
    import torch.distributed.nn.functional as torch_fn

    port = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(port)
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port[0]}", rank=rank, world_size=world)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            theirs = _program(rank, world, torch_fn, torch_dist.ReduceOp, on_gloo=True)
            ours = _program(rank, world, F, dist.ReduceOp, on_gloo=True)
            theirs["double backward"] = _double_backward(rank, torch_fn)
            ours["double backward"] = _double_backward(rank, F)
            if world == 3:
                theirs["subgroup"] = _subgroup(rank, torch_dist, torch_fn)
                ours["subgroup"] = _subgroup(rank, dist, F)
        theirs_seen, ours_seen = _what_comes_back(rank, world, torch_fn), _what_comes_back(rank, world, F)
    finally:
        torch_dist.destroy_process_group()
    return theirs, ours, theirs_seen, ours_seen


def _what_comes_back(rank, world, fn):
    """Which results are the caller's own tensors, what is written in place, what is raised and warned."""
    seen = {}
    x = _leaf(_x(rank))
    outs = [torch.empty(N, dtype=torch.float64) for _ in range(world)]
    ys = fn.all_to_all(outs, [x * 1 for _ in range(world)])
    seen["all_to_all returns the outputs"] = all(y is o for y, o in zip(ys, outs)) and outs[0].requires_grad
    out = torch.empty(world * N, dtype=torch.float64)
    y = fn.all_to_all_single(out, x.repeat(world))
    seen["all_to_all_single returns an alias of output"] = (y is out, y._base is out)
    out = torch.empty(N, dtype=torch.float64)
    y = fn.reduce_scatter(out, [x] * world)
    seen["reduce_scatter returns an alias of output"] = (y is out, y._base is out)
    strided = torch.zeros(N, 2, dtype=torch.float64)[:, 0]
    y = fn.reduce_scatter(strided, [x] * world)
    seen["a strided reduce_scatter output is not written"] = (strided.tolist(), y.tolist())
    for name in ("all_reduce", "broadcast", "reduce"):
        y = getattr(fn, name)(x, *((0,) if name != "all_reduce" else ()))
        seen[f"{name} returns a new tensor"] = y is not x and y.data_ptr() != x.data_ptr()
    unequal = [torch.ones(1)] * (world - 1) + [torch.ones(2)]
    for name, call in (("scatter of unequal sizes", lambda: fn.scatter(unequal)),
                       ("scatter of None", lambda: fn.scatter(None)),
                       ("all_to_all of too few", lambda: fn.all_to_all([torch.empty(1)] * world, []))):
        try:
            call()
            seen[name] = "did not raise"
        except Exception as exc:  # noqa: BLE001 - the type is what is compared
            seen[name] = type(exc).__name__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        one = torch.ones(1, dtype=torch.float64)
        fn.broadcast(one, 0), fn.reduce(one, 0), fn.all_reduce(one), fn.all_gather(one), fn.gather(one)
        fn.scatter([one] * world), fn.all_to_all([torch.empty_like(one) for _ in range(world)], [one] * world)
        fn.reduce_scatter(torch.empty_like(one), [one] * world)
        fn.all_to_all_single(torch.empty_like(one.repeat(world)), one.repeat(world))
    seen["warnings"] = [(w.category.__name__, str(w.message).split(" is deprecated")[0].rsplit(".", 1)[1],
                         w.filename) for w in caught]
    return seen


def _double_backward(rank, fn):
    """Gradients of gradients: the backward collectives are themselves differentiable."""
    x = _leaf(_x(rank))
    y = fn.all_reduce(x)
    ys = fn.all_gather(y * y)
    loss = sum((t * _w(10 * rank + i)).sum() for i, t in enumerate(ys))
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    z = fn.broadcast(g * g, src=0)
    (z * _w(rank)).sum().backward()
    return [g.detach(), x.grad]


def _subgroup(rank, module, fn):
    """Group [1, 2] of 3: its group ranks are not the global ones, which broadcast's backward compares."""
    sub = module.new_group([1, 2])
    if rank == 0:  # not a member: the collective warns and does nothing, so the input comes back, as does its gradient
        x = _leaf(_x(rank))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            y = fn.all_reduce(x, group=sub)
        (y * _w(rank)).sum().backward()
        return [y.detach(), x.grad]
    x = _leaf(_x(rank))
    y = fn.broadcast(x, src=1, group=sub)
    (y * _w(rank)).sum().backward()
    x2 = _leaf(_x(rank))
    y2 = fn.all_reduce(x2, group=sub)
    (y2 * _w(rank)).sum().backward()
    # Global rank 1 is src but group rank 0: its gradient is zeroed (PyTorch's quirk). Global rank 2 keeps
    # what the backward's reduce left on a non-root: backend-dependent (gloo leaves its reduce-scatter
    # chunk reduced, torchdist the rank's own gradient), so not compared.
    return [y.detach(), x.grad if rank == 1 else None, y2.detach(), x2.grad]


@pytest.mark.parametrize("world_size", [2, 3])
def test_same_values_and_gradients_as_torch_distributed(world_size):
    results = run_ranks(_beside_torch, world_size, backend="gloo", timeout=120, env={"GLOO_SOCKET_IFNAME": "lo"})
    wrong = [w for rank, (theirs, ours, _, _) in enumerate(results) for w in _mismatches(ours, theirs, f"rank {rank}")]
    assert not wrong, "\n".join(wrong)
    for _, _, theirs_seen, ours_seen in results:
        assert ours_seen == theirs_seen
    seen = results[0][3]
    assert seen["all_to_all returns the outputs"]
    assert seen["reduce_scatter returns an alias of output"] == (False, True)
    assert seen["a strided reduce_scatter output is not written"][0] == [0.0] * N
    assert [name for _, name, _ in seen["warnings"]] == ["broadcast", "all_reduce", "all_gather", "reduce_scatter",
                                                          "all_to_all_single"]
    assert {(category, filename) for category, _, filename in seen["warnings"]} == {("FutureWarning", __file__)}


def test_torchdist_nn_reexports_the_functional_collectives_as_torch_distributed_nn():
    import torch.distributed.nn as torch_nn

    names = ["broadcast", "gather", "scatter", "reduce", "reduce_scatter", "all_gather", "all_to_all",
             "all_to_all_single", "all_reduce"]
    assert sorted(F.__all__) == sorted(names)
    for name in names:
        assert getattr(torchdist.nn, name) is getattr(F, name) and name in torchdist.nn.__all__
        assert callable(getattr(torch_nn, name))
