"""Uneven inputs under ``ddp.join()`` / ``Join`` (inventory 74)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchdist.algorithms import Join
from torchdist.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torchdist.nn.parallel import DistributedDataParallel as DDP
from torchdist.optim.zero_redundancy_optimizer import ZeroRedundancyOptimizer
from torchdist.testing import run_ranks

from ._common import LR, TOL, build, full_batches, shard, state


def _iterations(world_size, iterations=None):
    return iterations or [2 + 2 * r for r in range(world_size)]  # by default rank r runs 2 + 2r


def _uneven(rank, world_size, divide_by_initial, model="mlp", hook=None, iterations=None, after=0):
    """Rank r trains ``iterations[r]`` steps inside the join, then every rank ``after`` more."""
    # "mlp": tiny buckets; "wide": a ~300 KiB coalesced bucket, in symmetric memory on shm,
    # which the joined ranks must shadow with a tensor at the same place
    ddp = DDP(build(model), bucket_cap_mb=0.002 if model == "mlp" else 25)
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    iterations = _iterations(world_size, iterations)
    batches = full_batches(model, world_size, max(iterations) + after)

    def step(x, y):
        opt.zero_grad()
        F.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()
        opt.step()
    with ddp.join(divide_by_initial_world_size=divide_by_initial):
        for x, y in batches[:iterations[rank]]:
            step(x, y)
    for x, y in batches[max(iterations):]:
        step(x, y)
    return state(ddp)


def _reference(world_size, divide_by_initial, name="mlp", iterations=None, after=0):
    model = build(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    iters = _iterations(world_size, iterations)
    for i, (x, y) in enumerate(full_batches(name, world_size, max(iters) + after)):
        active = [r for r in range(world_size) if iters[r] > i or i >= max(iters)]
        divisor = world_size if divide_by_initial else len(active)
        opt.zero_grad()
        sum(F.cross_entropy(model(shard(x, r)), shard(y, r)) for r in active).div(divisor).backward()
        opt.step()
    return state(model)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("divide_by_initial", [True, False])
def test_join_with_uneven_inputs_finishes_and_matches(world_size, divide_by_initial):
    results = run_ranks(_uneven, world_size, args=(divide_by_initial,), backend="gloo")
    want = _reference(world_size, divide_by_initial)
    # the last rank to join trained on every iteration: it matches the reference;
    # the post hook then gives every rank its parameters
    for rank, got in enumerate(results):
        for k, v in want.items():
            torch.testing.assert_close(got["module." + k], v, **TOL, msg=lambda m: f"rank {rank} {k}: {m}")


@pytest.mark.parametrize("iterations", [(0, 2), (1, 2), (0, 3, 1)], ids=str)
def test_join_averaging_over_active_ranks_then_training_on(iterations):
    """divide_by_initial_world_size=False: a rank that joined before any forward of its own
    shadowed with AVG while the others summed (a collective mismatch), and after the join
    each rank divided by the last count it had seen (gradients 1.5x at world 2)."""
    world_size = len(iterations)
    results = run_ranks(_uneven, world_size, args=(False, "mlp", None, list(iterations), 2), backend="gloo")
    want = _reference(world_size, False, iterations=list(iterations), after=2)
    for rank, got in enumerate(results):
        for k, v in want.items():
            torch.testing.assert_close(got["module." + k], v, **TOL, msg=lambda m: f"rank {rank} {k}: {m}")


@pytest.mark.parametrize("hook", [None, allreduce_hook])
def test_join_shadows_symmetric_buckets_on_shm(hook):
    results = run_ranks(_uneven, 3, args=(True, "wide", hook), backend="shm")
    want = _reference(3, True, "wide")
    for rank, got in enumerate(results):
        for k, v in want.items():
            torch.testing.assert_close(got["module." + k], v, **TOL, msg=lambda m: f"rank {rank} {k}: {m}")


def _throw(rank, world_size):
    ddp = DDP(build("mlp"))
    batches = full_batches("mlp", world_size, 1 + rank)
    try:
        with ddp.join(throw_on_early_termination=True):
            for x, y in batches:
                F.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()
    except RuntimeError as exc:
        return str(exc)
    return None


def test_throw_on_early_termination():
    early, late = run_ranks(_throw, 2, backend="gloo")
    assert early == "Rank 0 exhausted all inputs."
    assert late == "Detected at least one rank that exhausted inputs. Throwing across all ranks."


def _body_raises(rank, world_size):
    ddp = DDP(build("mlp"))
    try:
        with ddp.join():
            raise KeyError("from the body")
    except KeyError as exc:
        return repr(exc)


def test_exception_in_join_body_propagates_unchanged():
    assert run_ranks(_body_raises, 2, backend="gloo") == ["KeyError('from the body')"] * 2


def _ddp_and_zero(rank, world_size):
    ddp = DDP(build("mlp"))
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=LR)
    with Join([ddp, zero]):
        for x, y in full_batches("mlp", world_size, 1 + 2 * rank):
            zero.zero_grad()
            F.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()
            zero.step()
    return state(ddp)


def test_join_with_ddp_and_zero_finishes_with_identical_replicas():
    a, b = run_ranks(_ddp_and_zero, 2, backend="gloo")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_joinable_whose_constructor_skips_joinables_raises_assertion_error_as_pytorch():
    from torchdist.algorithms import Joinable

    class Forgetful(Joinable):
        def __init__(self) -> None:  # does not call Joinable.__init__
            pass

        def join_hook(self, **kwargs):
            raise AssertionError("not reached")

        join_device = torch.device("cpu")
        join_process_group = None

    with pytest.raises(AssertionError, match="constructor calls the ``Joinable`` constructor"):
        Join.notify_join_context(Forgetful())


def _sparse_under_join(rank, world_size):
    torch.manual_seed(0)
    bag = torch.nn.EmbeddingBag(8, 2, sparse=True, mode="sum")
    ddp = DDP(torch.nn.Sequential(bag))
    grads = []
    with ddp.join():
        for _ in range(2 + rank):  # rank 1 runs one iteration more: rank 0 shadows its sparse bucket
            bag.weight.grad = None
            ddp(torch.tensor([[rank, 5]])).sum().backward()
            assert bag.weight.grad.is_sparse
            grads.append(bag.weight.grad.to_dense()[:, 0].tolist())
    return grads


def test_a_joined_rank_shadows_a_sparse_bucket():
    both = [0.5, 0.5, 0, 0, 0, 1.0, 0, 0]  # rows 0 and 1 from one rank each, row 5 from both; / 2
    alone = [0, 0.5, 0, 0, 0, 0.5, 0, 0]  # rank 1 alone, still divided by the initial world size
    assert run_ranks(_sparse_under_join, 2, backend="gloo", timeout=60) == [[both] * 2, [both, both, alone]]
