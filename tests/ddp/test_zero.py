"""ZeroRedundancyOptimizer: same parameters as the unsharded optimizer, sharded state (inventory 81)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from torchdist.nn.parallel import DistributedDataParallel as DDP
from torchdist.optim.zero_redundancy_optimizer import ZeroRedundancyOptimizer
from torchdist.testing import run_ranks

from ._common import TOL, build, full_batches, shard, state


def _train(rank, world_size, use_zero, as_view, steps):
    ddp = DDP(build("cnn"))
    if use_zero:
        opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=0.01, parameters_as_bucket_view=as_view)
    else:
        opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    for x, y in full_batches("cnn", world_size, steps):
        opt.zero_grad()
        F.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()
        opt.step()
    out = {"model": state(ddp)}
    if use_zero:
        out["local_state_params"] = len(opt.optim.state)
        out["partition_sizes"] = list(opt._sizes)
        opt.consolidate_state_dict(to=0)
        out["full"] = opt.state_dict() if rank == 0 else None
        if rank != 0:
            try:
                opt.state_dict()
            except RuntimeError as exc:
                out["error"] = str(exc)
    else:
        out["full"] = opt.state_dict()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("as_view", [False, True])
def test_zero_matches_ddp_with_plain_optimizer(world_size, as_view):
    zero = run_ranks(_train, world_size, args=(True, as_view, 3), backend="gloo")
    plain = run_ranks(_train, world_size, args=(False, False, 3), backend="gloo")
    for rank in range(world_size):
        for k, v in plain[rank]["model"].items():
            torch.testing.assert_close(zero[rank]["model"][k], v, **TOL)
    n_params = len(list(build("cnn").parameters()))
    assert sum(z["local_state_params"] for z in zero) == n_params, "each parameter's state lives on one rank"
    assert all(z["local_state_params"] < n_params for z in zero)
    full, want = zero[0]["full"], plain[0]["full"]
    assert [g["params"] for g in full["param_groups"]] == [g["params"] for g in want["param_groups"]]
    assert sorted(full["state"]) == sorted(want["state"])
    for i, s in want["state"].items():
        for key, value in s.items():
            torch.testing.assert_close(full["state"][i][key], value, **TOL)
    assert "consolidate_state_dict" in zero[1]["error"]


def _load(rank, world_size, full):
    ddp = DDP(build("cnn"))
    opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=0.5)
    opt.load_state_dict(full)
    opt.consolidate_state_dict(to=0)
    return opt.state_dict() if rank == 0 else None, opt.param_groups[0]["lr"]


def test_load_state_dict_round_trips():
    full = run_ranks(_train, 2, args=(True, False, 2), backend="gloo")[0]["full"]
    again, lr = run_ranks(_load, 2, args=(full,), backend="gloo")[0]
    assert lr == 0.01
    for i, s in full["state"].items():
        for key, value in s.items():
            torch.testing.assert_close(again["state"][i][key], value)


def _lr_changed_after_a_step(rank, world_size):
    model = build("mlp")
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.randn(2, 10)).sum().backward()
    opt.step()
    scheduler.step()  # lr 0.05, set on the front's param_groups
    opt.consolidate_state_dict(to=0)
    after_scheduler = opt.state_dict()["param_groups"][0]["lr"] if rank == 0 else None
    opt.param_groups[0]["lr"] = 0.123  # by hand, after consolidating
    by_hand = opt.state_dict()["param_groups"][0]["lr"] if rank == 0 else None
    return after_scheduler, by_hand


def test_state_dict_holds_the_learning_rate_of_today_as_pytorchs():
    """It held the lr of the last step (0.1), so a checkpoint resumed with a stale lr."""
    assert run_ranks(_lr_changed_after_a_step, 2, backend="gloo")[0] == (0.05, 0.123)


def _factory(rank, world_size):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = ZeroRedundancyOptimizer(model.parameters(), functools.partial(torch.optim.SGD, momentum=0.9), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    return type(opt.optim).__name__, opt.optim.defaults["momentum"], model.weight.detach().clone()


def test_optimizer_class_may_be_a_factory_as_in_pytorch():
    first, second = run_ranks(_factory, 2, backend="gloo")
    assert first[:2] == ("SGD", 0.9) and torch.equal(first[2], second[2])


def _groups_and_errors(rank, world_size):
    opt = ZeroRedundancyOptimizer(build("mlp").parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    try:
        opt.state_dict()
        not_consolidated = None
    except RuntimeError as exc:
        not_consolidated = str(exc)
    try:
        ZeroRedundancyOptimizer([], torch.optim.SGD, lr=0.1)
        empty = None
    except ValueError as exc:
        empty = str(exc)
    weight = torch.nn.Parameter(torch.ones(2, 2))
    bad = {}
    for name, params, error in [("tensor", weight, TypeError), ("mixed", [weight, {"params": [weight]}], TypeError),
                                ("no params key", [{"lr": 0.1}], ValueError),
                                ("dtypes", [weight, torch.nn.Parameter(torch.ones(2, dtype=torch.float64))],
                                 ValueError)]:
        try:
            ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1)
            bad[name] = None
        except error as exc:
            bad[name] = str(exc)
    # groups whose params are generators keep every parameter
    grouped = ZeroRedundancyOptimizer([{"params": (p for p in build("mlp").parameters()), "lr": 0.2}],
                                      torch.optim.SGD, lr=0.1)
    bad["generator group"] = sum(len(g["params"]) for g in grouped.param_groups)
    return {k: v for k, v in opt.param_groups[0].items() if k != "params"}, not_consolidated, empty, bad


def test_param_groups_show_the_optimizer_defaults_and_errors_are_pytorchs():
    for rank, (group, not_consolidated, empty, bad) in enumerate(run_ranks(_groups_and_errors, 2, backend="gloo")):
        want = {k: v for k, v in torch.optim.SGD(build("mlp").parameters(), lr=0.1, momentum=0.9)
                .param_groups[0].items() if k != "params"}
        assert group == want  # weight_decay, nesterov, ... as in PyTorch, not only what was passed
        assert f"consolidate_state_dict(to={rank})" in not_consolidated
        assert empty == "ZeroRedundancyOptimizer got an empty parameter list"
        assert bad == {  # PyTorch's exception types and messages
            "tensor": "`params` argument should be an iterable of Tensors, but got torch.FloatTensor",
            "mixed": "`params` argument should be an iterable of Tensors or dicts",
            "no params key": "Each parameter group passed-in via `params` must have a 'params' key mapping to the "
                             "parameters in the group",
            "dtypes": "ZeroRedundancyOptimizer only supports using the same dense type for all parameters but got "
                      "both torch.FloatTensor and torch.DoubleTensor",
            "generator group": len(list(build("mlp").parameters()))}
