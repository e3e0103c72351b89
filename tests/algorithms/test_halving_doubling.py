"""Rabenseifner's halving-doubling all-reduce over the loopback transport.

Power-of-two worlds 1-8, uneven chunks (sizes not divisible by p, fewer
elements than ranks), every reduce op, and the dispatch through
``collectives.allreduce`` (non-powers of two fall back to the ring). Results
must be bit-identical on every rank. The schedule is in test_schedule.py.
"""

from __future__ import annotations

import pytest
import torch

from torchdist._algorithms import collectives, ring
from torchdist._algorithms.halving_doubling import halving_doubling_allreduce, is_power_of_two
from torchdist._algorithms.reduction import combiner
from torchdist._algorithms.select import Algo, allreduce_algo

from ._world import run_world

POWERS = [1, 2, 4, 8]
SIZES = [0, 1, 3, 7, 8, 1000, 4099]


def _allreduce(fn, comm, t: torch.Tensor, op: str = "SUM") -> torch.Tensor:
    fn(comm, t, combiner(op, t.dtype))
    return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("world", POWERS)
def test_sum_is_correct_and_bit_identical(world: int, dtype: torch.dtype) -> None:
    for n in SIZES:
        g = torch.Generator().manual_seed(n + world)
        inputs = [torch.randn(n, generator=g).to(dtype) for _ in range(world)]
        results = run_world(world, lambda comm, r: _allreduce(halving_doubling_allreduce, comm,
                                                              inputs[r].clone()))
        expected = torch.stack(inputs).double().sum(0)
        tol = 0.1 if dtype is torch.bfloat16 else 1e-5
        for out in results:
            assert torch.allclose(out.double(), expected, atol=tol), (world, n, dtype)
            assert torch.equal(out, results[0]), f"world {world}, n={n}, {dtype}: ranks differ in bits"


@pytest.mark.parametrize("op", ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.uint64])
def test_integer_reductions_are_exact(op: str, dtype: torch.dtype) -> None:
    world, n = 4, 37
    g = torch.Generator().manual_seed(3)
    wide = [torch.randint(1, 5, (n,), generator=g) for _ in range(world)]
    fold = {"SUM": torch.add, "PRODUCT": torch.mul, "MIN": torch.minimum, "MAX": torch.maximum,
            "BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
    expected = wide[0]
    for t in wide[1:]:
        expected = fold(expected, t)
    results = run_world(world, lambda comm, r: _allreduce(halving_doubling_allreduce, comm,
                                                          wide[r].to(dtype), op))
    for out in results:
        assert torch.equal(out.to(torch.int64), expected), (op, dtype)


def test_nan_payloads_and_signed_zeros_end_bit_identical() -> None:
    world, n = 8, 64
    inputs = [torch.zeros(n) for _ in range(world)]
    for r, t in enumerate(inputs):
        t[r::world] = float("nan")
        t[1::2] = -0.0 if r % 2 else 0.0
    for op in ("SUM", "MIN", "MAX"):
        results = run_world(world, lambda comm, r: _allreduce(halving_doubling_allreduce, comm,
                                                              inputs[r].clone(), op))
        bits = [out.view(torch.int32) for out in results]
        assert all(torch.equal(b, bits[0]) for b in bits), op


def test_matches_the_ring_within_rounding() -> None:
    world, n = 4, 10007
    g = torch.Generator().manual_seed(11)
    inputs = [torch.randn(n, generator=g) for _ in range(world)]
    hd = run_world(world, lambda comm, r: _allreduce(halving_doubling_allreduce, comm, inputs[r].clone()))
    rg = run_world(world, lambda comm, r: _allreduce(ring.ring_allreduce, comm, inputs[r].clone()))
    assert torch.allclose(hd[0], rg[0], atol=1e-5)


@pytest.mark.parametrize("world", [3, 4, 6, 8])
def test_entry_point_runs_it_forced_and_falls_back_to_the_ring(world: int, monkeypatch) -> None:
    monkeypatch.setenv("TORCHDIST_ALGO_ALLREDUCE", "halving_doubling")
    g = torch.Generator().manual_seed(world)
    inputs = [torch.randn(20000, generator=g) for _ in range(world)]
    results = run_world(world, lambda comm, r: _allreduce(collectives.allreduce, comm, inputs[r].clone()),
                        piece=1 << 16)
    assert all(torch.equal(out, results[0]) for out in results)
    assert torch.allclose(results[0], torch.stack(inputs).sum(0), atol=1e-4)


def test_selected_between_the_ring_threshold_and_8_mib_at_powers_of_two_from_4() -> None:
    assert allreduce_algo(2 << 20, 4) is Algo.HALVING_DOUBLING
    assert allreduce_algo(2 << 20, 8) is Algo.HALVING_DOUBLING
    assert allreduce_algo(64 << 20, 4) is Algo.RING  # within noise there; the ring needs less scratch
    assert allreduce_algo(2 << 20, 3) is Algo.RING
    assert allreduce_algo(2 << 20, 2) is Algo.RECURSIVE_DOUBLING
    assert allreduce_algo(8, 4) is Algo.RECURSIVE_DOUBLING
    assert [is_power_of_two(p) for p in range(1, 9)] == [True, True, False, True, False, False, False, True]
