"""Tensor arguments as PyTorch 2.13 treats them, found by running the same calls on both.

Local mistakes raise before anything is sent and leave the group usable; views
with flags (conjugate, negative) and aliased tensors give PyTorch's values; writing
a tensor does not bump its autograd version counter; MIN/MAX results are the same
bits on every rank.
"""

import pytest
import torch

import torchdist as dist
from torchdist.testing import run_ranks

BACKENDS = ["shm", "tcp"]


def _local_mistakes(rank, world):
    raised = {}

    def attempt(name, fn):
        try:
            fn()
        except (RuntimeError, ValueError, TypeError) as exc:
            raised[name] = type(exc).__name__
        else:
            raised[name] = "nothing"
    ints = torch.ones(3, dtype=torch.int32)
    attempt("premul int", lambda: dist.all_reduce(ints, op=dist._make_nccl_premul_sum(2.0)))
    attempt("band complex", lambda: dist.all_reduce(torch.ones(2, dtype=torch.complex64), op=dist.ReduceOp.BAND))
    attempt("all_to_all sizes", lambda: dist.all_to_all([torch.zeros(3)] * world, [torch.ones(4)] * world))
    attempt("all_to_all_single sizes", lambda: dist.all_to_all_single(torch.zeros(3 * world), torch.ones(2 * world)))
    attempt("all_gather_coalesced sizes",
            lambda: dist.all_gather_coalesced([[torch.zeros(4)] for _ in range(world)], [torch.ones(3)]))
    attempt("float8 fnuz", lambda: dist.broadcast(torch.zeros(2, dtype=torch.float8_e4m3fnuz), src=0))
    t = torch.ones(2)
    dist.all_reduce(t)  # the group still works
    return raised, t.tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_local_mistakes_raise_pytorchs_types_and_leave_the_group_usable(backend):
    for raised, after in run_ranks(_local_mistakes, 2, backend=backend, timeout=60):
        assert raised == {"premul int": "RuntimeError", "band complex": "ValueError",
                          "all_to_all sizes": "RuntimeError", "all_to_all_single sizes": "RuntimeError",
                          "all_gather_coalesced sizes": "RuntimeError", "float8 fnuz": "RuntimeError"}
        assert after == [2.0, 2.0]


def _views_and_autograd(rank, world):
    got = {}
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    z = (y * y).sum()  # saves y for backward
    w = torch.full((3,), 3.0)
    v = (x * w).sum()  # saves w, which does not require grad
    dist.all_reduce(y)
    dist.all_reduce(w)
    z.backward()  # PyTorch's collectives leave the version counter alone
    v.backward()
    got["version"], got["grad"] = (y._version, w._version), x.grad.tolist()
    base = torch.arange(2.0 * world) + 10 * rank
    out = torch.empty(2 * world)
    dist.all_to_all_single(out, torch._neg_view(base))  # a negative view: its values, not its memory
    got["neg a2a"] = out.tolist()
    c = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64) * (rank + 1)
    reduced = torch.empty(1, dtype=torch.complex64)
    dist.reduce_scatter_tensor(reduced, c.conj())
    got["conj rst"] = reduced.tolist()
    b = torch.arange(2.0 * world + 1) + 10 * rank
    dist.all_to_all_single(b[1:], b[:-1])  # overlapping: the input is read as it was
    got["overlap"] = b.tolist()
    empty = torch.empty(0, 3)
    dist.all_to_all_single(empty, torch.empty(0, 3))  # no rows at all
    got["no rows"] = tuple(empty.shape)
    return got


@pytest.mark.parametrize("backend", BACKENDS)
def test_flagged_views_aliases_and_saved_tensors_behave_as_in_pytorch(backend):
    world = 2
    results = run_ranks(_views_and_autograd, world, backend=backend, timeout=60)
    total = sum(r + 1 for r in range(world))
    for rank, got in enumerate(results):
        assert got["version"] == (0, 0) and got["grad"] == [8.0 * world + 3.0 * world] * 3
        assert got["no rows"] == (0, 3)
        assert got["neg a2a"] == [-(2.0 * rank + i + 10 * j) for j in range(world) for i in range(2)]
        want = (torch.tensor([1 + 2j, 3 - 1j]).conj() * total)[rank].item()
        assert got["conj rst"] == [want]
        # chunk j of the output receives rank j's input chunk ``rank``, as read before any write
        assert got["overlap"] == [10.0 * rank] + [10.0 * j + 2 * rank + i for j in range(world) for i in range(2)]


def _inputs_aliasing_outputs(rank, world, numel):
    """Each op with an input that shares memory with one of its outputs; what PyTorch gives."""
    full = lambda value: torch.full((numel,), float(value))  # noqa: E731
    got = {}
    pieces = [full(100 * rank + j) for j in range(world)]
    dist.all_to_all(pieces, pieces)
    got["all_to_all"] = [p[0].item() for p in pieces]
    slots = [full(0) for _ in range(world)]
    other = slots[(rank + 1) % world]
    other.fill_(rank)
    dist.all_gather(slots, other)
    got["all_gather"] = [s[0].item() for s in slots]
    slots = [full(0) for _ in range(world)] if rank == 0 else None
    mine = slots[1].fill_(rank) if rank == 0 else full(rank)
    dist.gather(mine, slots, dst=0)
    got["gather"] = [s[0].item() for s in slots] if rank == 0 else None
    pieces = [full(j) for j in range(world)] if rank == 0 else None
    mine = pieces[1] if rank == 0 else full(-1)
    dist.scatter(mine, pieces, src=0)
    got["scatter"] = mine[0].item()
    for name, slot in (("reduce_scatter own", rank), ("reduce_scatter other", (rank + 1) % world)):
        pieces = [full(j + 1) for j in range(world)]
        dist.reduce_scatter(pieces[slot], pieces)
        got[name] = pieces[slot][0].item()
    flat = torch.arange(float(world * numel))
    dist.reduce_scatter_single(flat.chunk(world)[rank], flat)  # FSDP's in-place pattern
    got["reduce_scatter_single"] = torch.equal(flat.chunk(world)[rank], (world * torch.arange(
        float(world * numel))).chunk(world)[rank])
    return got


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [3, 4])
def test_inputs_that_alias_outputs_are_read_before_anything_is_written(backend, world):
    numel = 1 << 16  # large enough that receives land while sends are still in flight
    for rank, got in enumerate(run_ranks(_inputs_aliasing_outputs, world, args=(numel,), backend=backend,
                                         timeout=60)):
        assert got["all_to_all"] == [100.0 * j + rank for j in range(world)]
        assert got["all_gather"] == [float(j) for j in range(world)]
        assert got["gather"] == ([float(j) for j in range(world)] if rank == 0 else None)
        assert got["scatter"] == float(rank)
        assert got["reduce_scatter own"] == got["reduce_scatter other"] == world * (rank + 1.0)
        assert got["reduce_scatter_single"]


def _signed_zero_max(rank, world, numel, op):
    zero = 0.0 if rank == 0 else -0.0
    t = torch.full((numel,), zero)
    dist.all_reduce(t, op=op)
    return torch.signbit(t).tolist()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("numel", [3, 1 << 20], ids=["small", "pipelined"])
@pytest.mark.parametrize("op", ["MAX", "MIN"])
def test_min_max_of_signed_zeros_are_the_same_bits_on_every_rank(backend, numel, op):
    results = run_ranks(_signed_zero_max, 2, args=(numel, getattr(dist.ReduceOp, op)), backend=backend, timeout=60)
    assert results[0] == results[1]


def _premul_factors(rank, world):
    got = []
    for factor in (2.0, 3.0, torch.tensor(0.5), torch.tensor(0.25)):  # equal ops to ==, not to the cache
        t = torch.ones(3)
        dist.all_reduce(t, op=dist.ReduceOp.PREMUL_SUM(factor))
        got.append(t[0].item())
    return got


@pytest.mark.parametrize("backend", BACKENDS)
def test_premul_sums_with_different_factors_are_different_reductions(backend):
    assert run_ranks(_premul_factors, 2, backend=backend, timeout=60) == [[4.0, 6.0, 1.0, 0.5]] * 2


def _premul_without_factor(rank, world):
    refused = []
    for call in (lambda t: dist.all_reduce(t, op=dist.ReduceOp.PREMUL_SUM),
                 lambda t: dist.reduce(t, 0, op=dist.ReduceOp.PREMUL_SUM),
                 lambda t: dist.reduce_scatter_tensor(torch.ones(1), t, op=dist.ReduceOp.PREMUL_SUM)):
        with pytest.raises(TypeError, match="PREMUL_SUM needs its factor"):
            call(torch.ones(world))
        refused.append(True)
    return refused


@pytest.mark.parametrize("backend", BACKENDS)
def test_premul_sum_without_its_factor_is_refused_as_in_pytorch(backend):
    """torch's binding refuses a bare ReduceOp.PREMUL_SUM with TypeError; it is not a SUM."""
    assert run_ranks(_premul_without_factor, 2, backend=backend, timeout=60) == [[True] * 3] * 2


def _premul_reduce(rank, world):
    t = torch.tensor([1.0, 2.0, 3.0])
    dist.reduce(t, dst=0, op=dist.ReduceOp.PREMUL_SUM(2.0))
    return t.tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_premul_reduce_scales_a_copy_of_the_non_roots_input(backend):
    """The root gets the scaled sum; every other rank's tensor is its own, unchanged (as
    with any other reduce op): the factor is applied to a copy there."""
    assert run_ranks(_premul_reduce, 3, backend=backend, timeout=60) == [[6.0, 12.0, 18.0]] + [[1.0, 2.0, 3.0]] * 2
