"""Every tensor collective through the public API, against torch computed locally.

One rank function runs a battery of ops and returns the mismatches it found, so
each (world size, dtype) pair costs one launch. Inputs are functions of the rank,
so every rank can compute what every op must produce.
"""

import functools
import os

import pytest
import torch

import torchdist as dist
from torchdist.testing import run_ranks

N = 6  # elements per rank: small, but uneven splits and odd worlds still bite

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.uint8, torch.bool, torch.complex64]


def _input(rank: int, dtype: torch.dtype, n: int = N) -> torch.Tensor:
    base = torch.arange(n, dtype=torch.float64) + rank + 1
    if dtype == torch.bool:
        return (base.long() + rank) % 3 == 0
    if dtype.is_complex:
        return torch.complex(base, torch.full_like(base, rank - 1.5)).to(dtype)
    return base.to(dtype)


def _fold(fn, world: int, dtype: torch.dtype) -> torch.Tensor:
    return functools.reduce(fn, [_input(r, dtype) for r in range(world)])


def _expected_reductions(world: int, dtype: torch.dtype) -> dict:
    ops = {dist.ReduceOp.SUM: lambda a, b: a + b}
    if dtype.is_complex:
        ops[dist.ReduceOp.AVG] = None
        return ops
    if dtype == torch.bool:
        ops.update({dist.ReduceOp.MAX: torch.logical_or, dist.ReduceOp.MIN: torch.logical_and,
                    dist.ReduceOp.BOR: torch.logical_or, dist.ReduceOp.BAND: torch.logical_and,
                    dist.ReduceOp.BXOR: torch.logical_xor})
        return ops
    ops.update({dist.ReduceOp.MAX: torch.maximum, dist.ReduceOp.MIN: torch.minimum,
                dist.ReduceOp.PRODUCT: lambda a, b: a * b})
    if dtype.is_floating_point:
        ops[dist.ReduceOp.AVG] = None
    else:
        ops.update({dist.ReduceOp.BAND: torch.bitwise_and, dist.ReduceOp.BOR: torch.bitwise_or,
                    dist.ReduceOp.BXOR: torch.bitwise_xor})
    return ops


def _battery(rank: int, world: int, dtype: torch.dtype) -> list[str]:
    wrong: list[str] = []

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            if dtype in (torch.float16, torch.bfloat16) and torch.allclose(got.double(), want.double(), rtol=1e-2):
                return
            wrong.append(f"rank {rank} {name}: got {got.tolist()}, want {want.tolist()}")

    mine = _input(rank, dtype)
    for op, fn in _expected_reductions(world, dtype).items():
        t = mine.clone()
        dist.all_reduce(t, op=op)
        if fn is None:  # AVG
            want = (_fold(lambda a, b: a + b, world, dtype) / world).to(dtype)
        else:
            want = _fold(fn, world, dtype)
        check(f"all_reduce {op!r}", t, want)
        for dst in range(world):
            t = mine.clone()
            dist.reduce(t, dst=dst, op=op)
            if rank == dst:
                check(f"reduce {op!r} to {dst}", t, want)
    for src in range(world):
        t = mine.clone()
        dist.broadcast(t, src=src)
        check(f"broadcast from {src}", t, _input(src, dtype))
    everyone = [_input(r, dtype) for r in range(world)]
    outs = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(outs, mine)
    for r in range(world):
        check(f"all_gather[{r}]", outs[r], everyone[r])
    flat = torch.empty(world * N, dtype=dtype)
    dist.all_gather_single(flat, mine)
    check("all_gather_single", flat, torch.cat(everyone))
    root = world - 1
    gathered = [torch.empty_like(mine) for _ in range(world)] if rank == root else None
    dist.gather(mine, gathered, dst=root)
    if rank == root:
        for r in range(world):
            check(f"gather[{r}]", gathered[r], everyone[r])
    got = torch.empty_like(mine)
    dist.scatter(got, [_input(10 + r, dtype) for r in range(world)] if rank == root else None, src=root)
    check("scatter", got, _input(10 + rank, dtype))
    # reduce_scatter: rank r's list entry j is _input(r * world + j); rank j gets the sum over r.
    pieces = [_input(rank * world + j, dtype) for j in range(world)]
    got = torch.empty_like(mine)
    dist.reduce_scatter(got, pieces)
    check("reduce_scatter", got, functools.reduce(lambda a, b: a + b,
                                                  [_input(r * world + rank, dtype) for r in range(world)]))
    got = torch.empty_like(mine)
    dist.reduce_scatter_single(got, torch.cat(pieces))
    check("reduce_scatter_single", got, functools.reduce(lambda a, b: a + b,
                                                         [_input(r * world + rank, dtype) for r in range(world)]))
    # all_to_all: rank r sends _input(100 r + j) to rank j.
    outs = [torch.empty_like(mine) for _ in range(world)]
    dist.all_to_all(outs, [_input(100 * rank + j, dtype) for j in range(world)])
    for r in range(world):
        check(f"all_to_all[{r}]", outs[r], _input(100 * r + rank, dtype))
    # all_to_all_single with uneven splits: rank r sends j + 1 rows to rank j.
    send = torch.cat([_input(100 * rank + j, dtype, n=j + 1) for j in range(world)])
    recv = torch.empty(world * (rank + 1), dtype=dtype)
    dist.all_to_all_single(recv, send, output_split_sizes=[rank + 1] * world,
                           input_split_sizes=[j + 1 for j in range(world)])
    check("all_to_all_single uneven", recv, torch.cat([_input(100 * r + rank, dtype, n=rank + 1) for r in range(world)]))
    coalesced = [mine.clone(), _input(rank + 7, dtype)]
    dist.all_reduce_coalesced(coalesced)
    check("all_reduce_coalesced[0]", coalesced[0], _fold(lambda a, b: a + b, world, dtype))
    outs = [[torch.empty_like(mine) for _ in range(2)] for _ in range(world)]
    dist.all_gather_coalesced(outs, [mine, _input(rank + 7, dtype)])
    for r in range(world):
        check(f"all_gather_coalesced[{r}][1]", outs[r][1], _input(r + 7, dtype))
    dist.barrier()
    return wrong


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_collective_matches_torch(world_size, dtype):
    results = run_ranks(_battery, world_size, args=(dtype,), backend="tcp", timeout=90)
    assert results == [[]] * world_size, "\n".join(w for ws in results for w in ws)


def _strided_and_empty(rank, world):
    # Non-contiguous outputs: only the strided elements change, the gaps keep their values.
    base = torch.full((4, 6), -1.0)
    view = base[:, ::2]
    view.copy_(torch.full((4, 3), float(rank + 1)))
    dist.all_reduce(view)
    reduced_ok = torch.equal(base[:, ::2], torch.full((4, 3), float(sum(range(1, world + 1))))) and torch.equal(
        base[:, 1::2], torch.full((4, 3), -1.0))
    outs_base = torch.zeros(world, 3, 2)
    dist.all_gather([outs_base[r, :, 0] for r in range(world)], torch.arange(3.0) * 0 + rank)
    gathered_ok = all(torch.equal(outs_base[r, :, 0], torch.full((3,), float(r))) for r in range(world)) and not \
        outs_base[:, :, 1].any()
    src = torch.arange(12.0).reshape(3, 4).t()  # non-contiguous input
    dst_base = torch.zeros(4, 3, 2)
    dist.broadcast(dst_base[:, :, 0] if rank else src, src=0)
    broadcast_ok = rank == 0 or (torch.equal(dst_base[:, :, 0], src) and not dst_base[:, :, 1].any())
    empty = torch.empty(0)
    dist.all_reduce(empty)
    dist.broadcast(empty, src=0)
    outs = [torch.empty(0) for _ in range(world)]
    dist.all_gather(outs, empty)
    return reduced_ok, gathered_ok, broadcast_ok


@pytest.mark.parametrize("world_size", [2, 3])
def test_non_contiguous_outputs_and_empty_tensors(world_size):
    assert run_ranks(_strided_and_empty, world_size, backend="tcp") == [(True, True, True)] * world_size


def _parameters_and_inference_tensors(rank, world):
    torch.manual_seed(rank)
    model = torch.nn.Linear(3, 2)
    for p in model.parameters():  # the common "start from rank 0's weights" idiom
        dist.broadcast(p, src=0)
    weight = model.weight
    dist.all_reduce(weight)  # a leaf that requires grad, written in place
    strided = torch.nn.Parameter(torch.full((2, 4), float(rank)))[:, ::2]
    dist.all_reduce(strided)  # a non-contiguous view of one: staged, then copied back
    gathered = [torch.nn.Parameter(torch.empty(2)) for _ in range(world)]
    dist.all_gather(gathered, torch.nn.Parameter(torch.full((2,), float(rank))))
    with torch.inference_mode():
        frozen = torch.full((2,), float(rank + 1))
    dist.all_reduce(frozen)
    dist.barrier()
    return (weight.detach().clone(), model.bias.detach().clone(), strided.detach().clone(),
            [g.detach().clone() for g in gathered], frozen.clone(), weight.requires_grad)


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_collectives_write_parameters_and_inference_tensors_in_place(backend):
    """As PyTorch's C++ collectives: autograd leaves and inference tensors are written in place."""
    world = 2
    results = run_ranks(_parameters_and_inference_tensors, world, backend=backend)
    torch.manual_seed(0)
    rank0 = torch.nn.Linear(3, 2)
    for weight, bias, strided, gathered, frozen, requires_grad in results:
        assert torch.equal(weight, rank0.weight.detach() * world)
        assert torch.equal(bias, rank0.bias.detach())
        assert torch.equal(strided, torch.full((2, 2), float(sum(range(world)))))
        assert [g.tolist() for g in gathered] == [[float(r)] * 2 for r in range(world)]
        assert frozen.tolist() == [float(sum(range(1, world + 1)))] * 2
        assert requires_grad


def _sparse(rank, world):
    uncoalesced = torch.sparse_coo_tensor([[rank, 2, 2]], [1.0, 2.0, 3.0], (4,))
    dist.all_reduce(uncoalesced)
    hybrid = torch.sparse_coo_tensor([[0, 1], [rank, rank]], [[1.0, 2.0], [3.0, 4.0]], (2, world, 2))
    work = dist.all_reduce(hybrid, async_op=True)
    work.wait()
    empty = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.int64), torch.zeros(0), (3,))
    dist.all_reduce(empty)
    try:
        dist.all_reduce(torch.sparse_coo_tensor([[0]], [1.0], (2,)), op=dist.ReduceOp.MAX)
        max_error = None
    except RuntimeError as exc:
        max_error = str(exc)
    return uncoalesced, hybrid, empty, max_error


@pytest.mark.parametrize("backend, world", [("tcp", 3), ("shm", 2)])
def test_sparse_all_reduce_sums_and_coalesces_as_gloo(backend, world):
    for uncoalesced, hybrid, empty, max_error in run_ranks(_sparse, world, backend=backend):
        assert uncoalesced.is_coalesced() and hybrid.is_coalesced()
        want = torch.zeros(4)
        for r in range(world):
            want[r] += 1.0
        want[2] += 5.0 * world
        assert torch.equal(uncoalesced.to_dense(), want)
        assert torch.equal(hybrid.to_dense(), torch.tensor([[1.0, 2.0], [3.0, 4.0]])[:, None, :].expand(2, world, 2))
        assert empty._nnz() == 0
        assert "only works with ReduceOp.SUM" in max_error


def _future_values(rank, world):
    gathered = torch.zeros(world, 2)
    work = dist.all_gather_single(gathered, torch.full((2,), float(rank)), async_op=True)
    per_rank = work.get_future().wait()
    exchanged = torch.zeros(world)
    work = dist.all_to_all_single(exchanged, torch.arange(float(world)) + 10 * rank, async_op=True)
    whole = work.get_future().wait()
    return ([t.shape for t in per_rank], all(t.data_ptr() == gathered[i].data_ptr() for i, t in enumerate(per_rank)),
            len(whole), whole[0] is exchanged or whole[0].data_ptr() == exchanged.data_ptr())


def test_async_results_are_pytorchs():
    """PyTorch's Work.result() and future: all_gather_single one view per rank of the
    output, all_to_all_single the whole output."""
    world = 3
    for shapes, views, count, whole in run_ranks(_future_values, world, backend="tcp"):
        assert shapes == [torch.Size([1, 2])] * world and views
        assert count == 1 and whole


def _random_sum_is_bit_identical(rank, world):
    torch.manual_seed(rank)
    t = torch.randn(100_003)  # odd size: uneven ring chunks
    dist.all_reduce(t)
    small = torch.randn(7)
    dist.all_reduce(small)
    return t, small


@pytest.mark.parametrize("world_size", [3, 4])
def test_float_results_are_bit_identical_across_ranks(world_size):
    results = run_ranks(_random_sum_is_bit_identical, world_size, backend="tcp")
    for t, small in results[1:]:
        assert torch.equal(t, results[0][0]) and torch.equal(small, results[0][1])


def _async_ops(rank, world):
    t = torch.full((1 << 18,), float(rank))
    work = dist.all_reduce(t, async_op=True)
    busy = torch.randn(200, 200) @ torch.randn(200, 200)  # compute while the op is in flight
    assert work.wait() is True
    future_value = work.get_future().wait()[0]
    handles = [dist.all_reduce(torch.ones(3) * i, async_op=True) for i in range(50)]
    torch.futures.wait_all([h.get_future() for h in handles])
    sync_result = dist.all_reduce(torch.ones(1))
    return t[0].item(), future_value is t, work.is_completed(), busy.shape, sync_result


def test_async_op_returns_work_and_overlaps_compute():
    results = run_ranks(_async_ops, 2, backend="tcp")
    assert results == [(1.0, True, True, torch.Size([200, 200]), None)] * 2


def _local_validation_errors(rank, world):
    errors = {}

    def expect(name, exc_type, fn):
        try:
            fn()
        except exc_type as exc:
            errors[name] = str(exc)
        else:
            errors[name] = "did not raise"

    c = torch.ones(2, dtype=torch.complex64)
    expect("complex max", ValueError, lambda: dist.all_reduce(c, op=dist.ReduceOp.MAX))
    mixed = [torch.ones(2)] * (world - 1) + [torch.ones(2, dtype=torch.int64)]
    expect("dtypes", ValueError, lambda: dist.all_gather(mixed, torch.ones(2)))
    expect("list size", RuntimeError, lambda: dist.all_gather([torch.ones(2)] * (world + 1), torch.ones(2)))
    # the types PyTorch raises: ValueError from its Python checks, RuntimeError from its backend's
    expect("output size", RuntimeError, lambda: dist.all_gather_single(torch.ones(2 * world + 1), torch.ones(2)))
    expect("splits", RuntimeError, lambda: dist.all_to_all_single(torch.ones(4), torch.ones(4), [1] * world,
                                                                  [5] * world))
    expect("int avg", RuntimeError, lambda: dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.AVG))
    expect("float band", RuntimeError, lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND))
    expect("complex max scatter", RuntimeError,
           lambda: dist.reduce_scatter_single(torch.ones(1, dtype=torch.complex64),
                                              torch.ones(world, dtype=torch.complex64), op=dist.ReduceOp.MAX))
    expect("int op", TypeError, lambda: dist.all_reduce(torch.ones(2), op=5))
    expect("float8 sum", RuntimeError, lambda: dist.all_reduce(torch.zeros(2, dtype=torch.float8_e4m3fn)))
    expect("root", RuntimeError, lambda: dist.broadcast(torch.ones(1), src=world))
    expect("both roots", ValueError, lambda: dist.broadcast(torch.ones(1), src=0, group_src=0))
    expect("gather non-root", ValueError, lambda: dist.gather(torch.ones(1), [torch.ones(1)] * world, dst=0)
           if rank else (_ for _ in ()).throw(ValueError("root")))
    expect("a2a contiguous", ValueError, lambda: dist.all_to_all_single(torch.ones(4, 2).t(), torch.ones(2, 4)))
    expect("send to self", ValueError, lambda: dist.send(torch.ones(1), dst=rank))
    expect("isend to self", RuntimeError, lambda: dist.isend(torch.ones(1), dst=rank))
    dist.barrier()  # nothing above reached the wire: the group is still in step
    return errors


def _local_validation_errors_on_two_hosts(rank, world):
    os.environ["TORCHDIST_HOST_ID"] = f"host{rank // 2}"  # hosts {0, 1} and {2}: hierarchical
    dist.init_process_group("auto", init_method="env://", rank=rank, world_size=world)
    try:
        assert type(dist.group.WORLD.backend).__name__ == "HierarchicalBackend"
        return _local_validation_errors(rank, world)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["tcp", "hierarchical"])
def test_local_mistakes_raise_before_anything_is_sent(backend):
    if backend == "hierarchical":
        errors = run_ranks(_local_validation_errors_on_two_hosts, 3, timeout=60)[1]
    else:
        errors = run_ranks(_local_validation_errors, 2, backend=backend)[1]
    assert "does not support MAX on complex tensors" in errors["complex max"]
    assert "different dtypes" in errors["dtypes"]
    assert "one per rank" in errors["list size"]
    assert "must hold world_size" in errors["output size"]
    assert "split_sizes" in errors["splits"]
    assert "result type Float can't be cast to the desired output type Long" in errors["int avg"]
    assert "only defined for integer and bool tensors" in errors["float band"]
    assert "does not support MAX on complex tensors" in errors["complex max scatter"]
    assert "ReduceOp" in errors["int op"]
    assert "SUM is not supported for torch.float8_e4m3fn tensors" in errors["float8 sum"]
    assert "invalid root rank" in errors["root"]
    assert "Can't specify both" in errors["both roots"]
    assert "requires empty output on non-root" in errors["gather non-root"]
    assert errors["a2a contiguous"] == "Tensors must be contiguous"
    assert "should not be the same as the rank of the current process" in errors["send to self"]
    assert "should not be the same as the rank of the current process" in errors["isend to self"]
