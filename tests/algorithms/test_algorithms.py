"""Every algorithm, at world sizes 1-8, over the in-process loopback transport.

Values are checked against torch computed locally, and results of reductions
must be bit-identical on every rank (random floats, odd world sizes included).
The loopback is strict (a collective send completes only when received), so
any ordering that could deadlock on full socket buffers deadlocks here.
"""

from __future__ import annotations

import pytest
import torch

from torchdist._algorithms import collectives, direct, halving_doubling, recursive, ring, tree
from torchdist._algorithms.comm import chunk_bounds, copy_into
from torchdist._algorithms.reduction import PieceReducer, combiner

from ._world import run_world

WORLDS = range(1, 9)
SIZES = [0, 1, 7, 1000]


def _inputs(world: int, n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return [torch.randn(n, generator=g).to(dtype) for _ in range(world)]
    return [torch.randint(0, 100, (n,), generator=g).to(dtype) for _ in range(world)]


ALLREDUCES = {
    "ring": ring.ring_allreduce,
    "recursive_doubling": recursive.recursive_doubling_allreduce,
    "direct": direct.direct_allreduce,
}


@pytest.mark.parametrize("algo", ALLREDUCES)
@pytest.mark.parametrize("world", WORLDS)
def test_allreduce_sum_is_correct_and_bit_identical(algo: str, world: int) -> None:
    for n in SIZES:
        inputs = _inputs(world, n, seed=n)
        results = run_world(world, lambda comm, r: _allreduce(ALLREDUCES[algo], comm, inputs[r].clone()))
        expected = torch.stack(inputs).double().sum(0).float()
        for out in results:
            assert torch.allclose(out, expected, atol=1e-5), (algo, world, n)
            assert torch.equal(out, results[0]), f"{algo} at world {world}, n={n}: ranks differ in bits"


def _allreduce(fn, comm, t):
    fn(comm, t, combiner("SUM", t.dtype))
    return t


FINISHED_ALLREDUCES = {"collectives": collectives.allreduce, "ring": ring.ring_allreduce,
                       "halving_doubling": halving_doubling.halving_doubling_allreduce}


@pytest.mark.parametrize("algo", FINISHED_ALLREDUCES)
@pytest.mark.parametrize("world", WORLDS)
def test_allreduce_finish_touches_every_element_exactly_once(algo: str, world: int) -> None:
    """AVG's finisher: a marker added by ``finish`` shows up exactly once per element."""
    if algo == "halving_doubling" and not halving_doubling.is_power_of_two(world):
        pytest.skip("halving-doubling needs a power-of-two group")
    fn = FINISHED_ALLREDUCES[algo]
    for n in SIZES + [5000]:
        inputs = _inputs(world, n, torch.float64, seed=n)
        results = run_world(world, lambda comm, r: _finished(fn, comm, inputs[r].clone()))
        expected = torch.stack(inputs).sum(0) / world + 1000
        for out in results:
            assert torch.allclose(out, expected), (algo, world, n)
            assert torch.equal(out, results[0]), f"{algo} at world {world}, n={n}: ranks differ in bits"


def _finished(fn, comm, t):
    fn(comm, t, combiner("SUM", t.dtype), lambda piece: piece.div_(comm.size).add_(1000))
    return t


@pytest.mark.parametrize("op", ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.uint16, torch.uint64, torch.bool])
def test_integer_reductions_are_exact(op: str, dtype: torch.dtype) -> None:
    world, n = 3, 50
    inputs = [t % 4 + 1 if dtype is not torch.bool else t % 2 == 0
              for t in _inputs(world, n, torch.int64, seed=5)]
    inputs = [t.to(dtype) for t in inputs]
    wide = [t.to(torch.int64) for t in inputs]
    fold = {"SUM": torch.add, "PRODUCT": torch.mul, "MIN": torch.minimum, "MAX": torch.maximum,
            "BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
    expected = wide[0]
    for t in wide[1:]:
        expected = fold(expected, t)
    if dtype is torch.bool:
        expected = expected != 0 if op in ("SUM", "BOR", "MAX") else expected.bool() if op != "BXOR" \
            else expected % 2 == 1
    for algo in ALLREDUCES.values():
        results = run_world(world, lambda comm, r: _op(algo, comm, inputs[r].clone(), op))
        for out in results:
            assert torch.equal(out.to(torch.int64), expected.to(torch.int64)), (op, dtype, algo)


def _op(fn, comm, t, op):
    fn(comm, t, combiner(op, t.dtype))
    return t


def test_unsigned_min_max_order_values_as_unsigned() -> None:
    a = torch.tensor([1, 2 ** 31], dtype=torch.int64).to(torch.uint32)
    b = torch.tensor([2 ** 31 + 5, 3], dtype=torch.int64).to(torch.uint32)
    lo, hi = a.clone(), a.clone()
    combiner("MIN", torch.uint32)(lo, b)
    combiner("MAX", torch.uint32)(hi, b)
    assert lo.to(torch.int64).tolist() == [1, 3]
    assert hi.to(torch.int64).tolist() == [2 ** 31 + 5, 2 ** 31]


def test_piece_reducer_reduces_exactly_what_arrived() -> None:
    acc, incoming = torch.zeros(10), torch.arange(10.0)
    reducer = PieceReducer(acc, incoming, combiner("SUM", acc.dtype), piece_bytes=8)
    reducer(4 * 3 + 2)  # three whole elements and half of the fourth
    assert acc.tolist()[:4] == [0.0, 1.0, 2.0, 0.0]
    reducer(40)
    assert acc.tolist() == list(map(float, range(10)))


@pytest.mark.parametrize("world", WORLDS)
def test_ring_reduce_scatter_and_allgather_with_uneven_chunks(world: int) -> None:
    n = 3 * world + 2
    inputs = _inputs(world, n, seed=world)
    bounds = chunk_bounds(n, world)

    def fn(comm, r):
        chunks = [inputs[r][a:b] for a, b in bounds]
        out = torch.empty(bounds[r][1] - bounds[r][0])
        ring.ring_reduce_scatter(comm, chunks, combiner("SUM", out.dtype), owned=0, output=out)
        gathered = [torch.empty(b - a) for a, b in bounds]
        gathered[r].copy_(out)
        ring.ring_allgather(comm, gathered, owned=0)
        return out, torch.cat(gathered)
    results = run_world(world, fn)
    expected = torch.stack(inputs).sum(0)
    for r, (out, full) in enumerate(results):
        a, b = bounds[r]
        assert torch.allclose(out, expected[a:b], atol=1e-5)
        assert torch.equal(full, results[0][1])
        assert torch.allclose(full, expected, atol=1e-5)
    for r in range(world):  # reduce-scatter leaves its inputs intact
        assert torch.equal(inputs[r], _inputs(world, n, seed=world)[r])


@pytest.mark.parametrize("world", WORLDS)
def test_broadcast_and_reduce_from_every_root(world: int) -> None:
    for n in (0, 5, 3000):
        inputs = _inputs(world, n, seed=n + world)
        for root in range(world):
            for bcast in (tree.binomial_broadcast, lambda c, t, rt: tree.chain_broadcast(c, t, rt, 1000)):
                results = run_world(world, lambda comm, r: _bcast(bcast, comm, inputs[r].clone(), root))
                assert all(torch.equal(out, inputs[root]) for out in results)
            for reduce in (tree.binomial_reduce, tree.ring_reduce):
                if reduce is tree.ring_reduce and n < world:
                    continue
                results = run_world(world, lambda comm, r: _reduce(reduce, comm, inputs[r].clone(), root))
                assert torch.allclose(results[root], torch.stack(inputs).sum(0), atol=1e-4)


def _bcast(fn, comm, t, root):
    fn(comm, t, root)
    return t


def _reduce(fn, comm, t, root):
    fn(comm, t, root, combiner("SUM", t.dtype))
    return t


@pytest.mark.parametrize("world", WORLDS)
def test_alltoall_gather_scatter_barrier_and_direct_collectives(world: int) -> None:
    def fn(comm, r):
        p = comm.size
        ins = [torch.full((r + j + 1,), float(10 * r + j)) for j in range(p)]
        out_pair = [torch.empty(j + r + 1) for j in range(p)]
        out_direct = [torch.empty(j + r + 1) for j in range(p)]
        direct.alltoall(comm, out_pair, ins, pairwise=True)
        direct.alltoall(comm, out_direct, ins, pairwise=False)
        root = p - 1
        gathered = [torch.empty(2) for _ in range(p)] if r == root else None
        direct.gather(comm, gathered, torch.full((2,), float(r)), root)
        got = torch.empty(3)
        direct.scatter(comm, got, [torch.full((3,), float(j)) for j in range(p)] if r == root else None, root)
        tree.barrier(comm)
        pieces = [torch.empty(j + 1) for j in range(p)]
        pieces[r].fill_(r)
        direct.direct_allgather(comm, pieces)
        rs_out = torch.empty(4)
        direct.direct_reduce_scatter(comm, [torch.full((4,), float(r + j)) for j in range(p)],
                                     combiner("SUM", torch.float32), rs_out)
        return out_pair, out_direct, gathered, got, pieces, rs_out
    for r, (pair, dire, gathered, got, pieces, rs_out) in enumerate(run_world(world, fn)):
        for j in range(world):
            assert torch.equal(pair[j], torch.full((j + r + 1,), float(10 * j + r)))
            assert torch.equal(dire[j], pair[j])
            assert torch.equal(pieces[j], torch.full((j + 1,), float(j)))
        if r == world - 1:
            assert [g[0].item() for g in gathered] == list(map(float, range(world)))
        assert got[0].item() == r
        assert rs_out[0].item() == sum(q + r for q in range(world))


@pytest.mark.parametrize("world", [2, 3, 5])
def test_entry_points_choose_an_algorithm_and_agree(world: int, monkeypatch) -> None:
    inputs = _inputs(world, 20000, seed=world)  # 80 KB: large enough for the ring
    expected = None
    for forced in ("direct", "recursive_doubling", "ring"):
        monkeypatch.setenv("TORCHDIST_ALGO_ALLREDUCE", forced)
        results = run_world(world, lambda comm, r: _allreduce(collectives.allreduce, comm, inputs[r].clone()),
                            piece=1 << 16)
        assert all(torch.equal(out, results[0]) for out in results)
        expected = results[0] if expected is None else expected
        assert torch.allclose(results[0], expected, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_copy_into_matches_tensor_copy(dtype: torch.dtype) -> None:
    """One memmove for large contiguous same-dtype pairs, ``copy_`` otherwise
    (small, strided, converting): every case gives what ``copy_`` gives."""
    source = _inputs(1, 200_000, torch.float32 if dtype.is_floating_point else torch.int64)[0].to(dtype)
    cases = [
        (torch.empty_like(source), source),  # large: memmove
        (torch.empty(100, dtype=dtype), source[:100]),  # small
        (torch.empty(2 * source.numel(), dtype=dtype)[::2], source),  # strided destination
        (torch.empty(source.numel() // 2, dtype=dtype), source[::2]),  # strided source
        (torch.empty(source.numel(), dtype=torch.float64), source),  # converting
        (torch.empty(0, dtype=dtype), source[:0]),
    ]
    for dst, src in cases:
        copy_into(dst, src)
        assert torch.equal(dst, src.to(dst.dtype))
