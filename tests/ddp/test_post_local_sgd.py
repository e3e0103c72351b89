"""Post-local SGD: the hook, the model averagers and PostLocalSGDOptimizer.

Each training run is checked against a simulation of the ranks in the test
process (one plain model per rank; gradients averaged over the groups the hook
uses; parameters averaged at the averager's steps), and against the same
program on torch.distributed's gloo.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F

import torchdist
from torchdist.algorithms.ddp_comm_hooks import post_localSGD_hook as post_localSGD
from torchdist.algorithms.model_averaging import averagers, hierarchical_model_averager, utils
from torchdist.nn.parallel import DistributedDataParallel as DDP
from torchdist.optim import PostLocalSGDOptimizer
from torchdist.testing import free_port, run_ranks

from ._common import LR, TOL, build, full_batches, shard

STEPS = 7


def _snapshot(module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _train(ddp, opt, rank: int, world_size: int, after_step=None) -> list[list[torch.Tensor]]:
    """``STEPS`` steps on this rank's shard of the mlp batches; the parameters after each."""
    history = []
    for x, y in full_batches("mlp", world_size, STEPS):
        opt.zero_grad()
        F.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()
        opt.step()
        if after_step is not None:
            after_step()
        history.append(_snapshot(ddp))
    return history


def _blocks(world_size: int, size: int) -> list[list[int]]:
    return [list(range(i, i + size)) for i in range(0, world_size, size)]


def _simulate(world_size: int, steps: int, start_iter: int, local_groups, averaging_groups) -> list[list]:
    """Each rank's parameters after each step. Gradients are averaged over the whole world before
    ``start_iter`` and over the blocks ``local_groups`` after (None: not at all); after step s the
    parameters are averaged over the blocks ``averaging_groups(s)`` (None: not averaged)."""
    models = [build("mlp") for _ in range(world_size)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    history = [[] for _ in range(world_size)]
    for step, (x, y) in enumerate(full_batches("mlp", world_size, steps)):
        grads = []
        for rank, model in enumerate(models):
            model.zero_grad()
            F.cross_entropy(model(shard(x, rank)), shard(y, rank)).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        groups = [list(range(world_size))] if step < start_iter else local_groups
        for block in groups or []:
            for i in range(len(grads[0])):
                mean = torch.stack([grads[r][i] for r in block]).mean(0)
                for r in block:
                    grads[r][i] = mean
        for rank, (model, opt) in enumerate(zip(models, opts)):
            for p, g in zip(model.parameters(), grads[rank]):
                p.grad = g
            opt.step()
        for block in averaging_groups(step) or []:
            params = [list(models[r].parameters()) for r in block]
            with torch.no_grad():
                for i in range(len(params[0])):
                    mean = torch.stack([params[k][i] for k in range(len(block))]).mean(0)
                    for k in range(len(block)):
                        params[k][i].copy_(mean)
        for rank, model in enumerate(models):
            history[rank].append(_snapshot(model))
    return history


def _assert_histories(got: list, want: list) -> None:
    for step, (g, w) in enumerate(zip(got, want)):
        for i, (a, b) in enumerate(zip(g, w)):
            torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"step {step}, parameter {i}: {m}")


# -- the hook and PeriodicModelAverager against the simulation ------------------------------------------------------

def _train_post_local(rank, world_size, start_iter, subgroup_size, period, use_optimizer):
    subgroup = None
    if subgroup_size is not None:
        subgroup, _ = torchdist.new_subgroups(group_size=subgroup_size)
    ddp = DDP(build("mlp"))
    state = post_localSGD.PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=start_iter,
                                            post_local_gradient_allreduce=subgroup_size is not None)
    ddp.register_comm_hook(state, post_localSGD.post_localSGD_hook)
    averager = averagers.PeriodicModelAverager(period=period, warmup_steps=start_iter)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    if use_optimizer:
        opt = PostLocalSGDOptimizer(opt, averager)
    history = _train(ddp, opt, rank, world_size,
                     None if use_optimizer else lambda: averager.average_parameters(ddp.parameters()))
    return history, state.iter, averager.step


@pytest.mark.parametrize("world_size,subgroup_size", [(2, None), (3, None), (2, 1), (3, 1), (2, 2)])
@pytest.mark.parametrize("use_optimizer", [False, True], ids=["averager", "optimizer"])
def test_global_then_local_gradients_and_periodic_averaging(world_size, subgroup_size, use_optimizer):
    start_iter, period = 2, 3
    results = run_ranks(_train_post_local, world_size, args=(start_iter, subgroup_size, period, use_optimizer),
                        backend="gloo", timeout=90)
    local = None if subgroup_size is None else _blocks(world_size, subgroup_size)
    everyone = [list(range(world_size))]
    want = _simulate(world_size, STEPS, start_iter, local,
                     lambda s: everyone if s >= start_iter and (s - start_iter) % period == 0 else None)
    for rank, (history, hook_iter, averager_step) in enumerate(results):
        _assert_histories(history, want[rank])
        assert hook_iter == start_iter  # the count stops at the switch, as in PyTorch
        assert averager_step == STEPS
    # after local steps the replicas differ (when the gradients were not averaged), after averaging they agree
    if subgroup_size is None or subgroup_size < world_size:
        assert not torch.equal(results[0][0][start_iter + 1][0], results[1][0][start_iter + 1][0])
    assert all(torch.equal(results[0][0][start_iter + period][i], r[0][start_iter + period][i])
               for r in results for i in range(len(r[0][0])))


def _default_subgroup(rank, world_size):
    ddp = DDP(build("mlp"))
    state = post_localSGD.PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=1)
    ddp.register_comm_hook(state, post_localSGD.post_localSGD_hook)
    ddp(torch.randn(2, 10)).sum().backward()  # global
    try:
        ddp(torch.randn(2, 10)).sum().backward()
    except ValueError as exc:
        return str(exc)
    return None


def test_default_subgroup_needs_a_group_size_on_cpu():
    """PyTorch's new_subgroups() sizes the intra-node groups by CUDA devices and raises ValueError without."""
    for message in run_ranks(_default_subgroup, 2, backend="gloo"):
        assert message is not None and "group_size" in message


# -- HierarchicalModelAverager ------------------------------------------------------------------------------------

def _train_hierarchical(rank, world_size, levels, warmup):
    subgroup, _ = torchdist.new_subgroups(group_size=1)
    ddp = DDP(build("mlp"))
    ddp.register_comm_hook(post_localSGD.PostLocalSGDState(None, subgroup, warmup), post_localSGD.post_localSGD_hook)
    opt = PostLocalSGDOptimizer(torch.optim.SGD(ddp.parameters(), lr=LR),
                                hierarchical_model_averager.HierarchicalModelAverager(levels, warmup_steps=warmup))
    return _train(ddp, opt, rank, world_size)


def test_hierarchical_averager_averages_at_the_largest_dividing_period():
    world_size, warmup = 4, 1
    levels = OrderedDict([(2, 2), (4, 4)])
    results = run_ranks(_train_hierarchical, world_size, args=(levels, warmup), backend="gloo", timeout=90)

    def averaging_groups(step):
        if step < warmup:
            return None
        for period, size in reversed(levels.items()):
            if step % period == 0:
                return _blocks(world_size, size)
        return None

    want = _simulate(world_size, STEPS, warmup, _blocks(world_size, 1), averaging_groups)
    for rank, history in enumerate(results):
        _assert_histories(history, want[rank])


def _hierarchical_errors(rank, world_size):
    errors = []
    for levels in [OrderedDict(), OrderedDict([(0, 2), (4, 2)]), OrderedDict([(2, 1), (4, 1)])]:
        try:
            hierarchical_model_averager.HierarchicalModelAverager(levels)
        except ValueError as exc:
            errors.append(str(exc))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hierarchical_model_averager.HierarchicalModelAverager(OrderedDict([(1, 2)]))
    errors.append(str(caught[0].message))
    return errors


def test_hierarchical_averager_validation_matches_torch():
    want = ["Arg ``period_group_size_dict`` must not be empty.",
            "The minimum period in arg ``period_group_size_dict`` must be a positive value.",
            "The last value in arg ``period_group_size_dict`` 1 must be equal to the size of arg "
            "``process_group`` 2."]
    got = run_ranks(_hierarchical_errors, 2, backend="gloo")[0]
    assert got[:3] == want
    assert got[3].startswith("When the maximum period in arg ``period_group_size_dict`` is 1")


# -- utils, validation, non-members ----------------------------------------------------------------------------

def test_get_params_to_average_keeps_params_with_gradients():
    import torch.distributed.algorithms.model_averaging.utils as torch_utils

    model = build("mlp")
    model(torch.randn(2, 10)).sum().backward()
    model.out.bias.grad = None
    groups = [{"params": [model.net1.weight, model.out.bias]}, {"params": list(model.net2.parameters())}]
    for params in (list(model.parameters()), groups):
        got = utils.get_params_to_average(params)
        assert [id(p) for p in got] == [id(p) for p in torch_utils.get_params_to_average(params)]
        assert all(p.grad is not None for p in got) and all(p is not model.out.bias for p in got)
    for fn in (utils.get_params_to_average, torch_utils.get_params_to_average):
        with pytest.raises(NotImplementedError,
                           match="Parameter input of type <class 'torch.Tensor'> is not supported"):
            fn([torch.ones(2)])


def test_periodic_averager_validation_matches_torch():
    import torch.distributed.algorithms.model_averaging.averagers as torch_averagers

    group = object()  # validation happens before any use of the group
    for module in (averagers, torch_averagers):
        with pytest.raises(ValueError, match=r"Arg ``warmup_steps`` must be a non-negative number\.$"):
            module.PeriodicModelAverager(period=2, warmup_steps=-1, process_group=group)
        with pytest.raises(ValueError, match=r"Arg ``period`` must be a positive value\.$"):
            module.PeriodicModelAverager(period=0, process_group=group)
        with pytest.warns(UserWarning, match="When period is 1, no need to use model averaging"):
            module.PeriodicModelAverager(period=1, process_group=group)
        with pytest.raises(TypeError, match="Invariant encountered: value was None"):
            module.PeriodicModelAverager(period=2)  # no default group
        with pytest.raises(TypeError):
            module.ModelAverager(process_group=group)  # abstract


def _average_tensors(rank, world_size):
    outsider = torchdist.new_group([0, 1])
    tensors = [torch.full((2, 3), float(rank)), torch.arange(4, dtype=torch.float64) * (rank + 1)]
    utils.average_parameters(iter(tensors), outsider)  # plain tensors, as PyTorch's accepts
    fresh = torch.full((2,), float(rank))
    utils.average_parameters(iter([fresh]), None)
    return tensors, fresh


def test_average_parameters_takes_tensors_and_skips_non_members():
    results = run_ranks(_average_tensors, 3, backend="gloo")
    for rank in (0, 1):
        tensors, _ = results[rank]
        assert torch.equal(tensors[0], torch.full((2, 3), 0.5))
        # cast back to its dtype after the float64 flat buffer
        torch.testing.assert_close(tensors[1], torch.arange(4, dtype=torch.float64) * 1.5)
    assert torch.equal(results[2][0][0], torch.full((2, 3), 2.0))  # rank 2 is outside the group
    for _, fresh in results:
        assert torch.equal(fresh, torch.full((2,), 1.0))


# -- PostLocalSGDOptimizer's optimizer API ----------------------------------------------------------------------

def _optimizer_api(rank, world_size):
    model = build("mlp")
    opt = PostLocalSGDOptimizer(torch.optim.SGD(list(model.net1.parameters()), lr=LR, momentum=0.9),
                                averagers.PeriodicModelAverager(period=2, warmup_steps=0))
    opt.add_param_group({"params": list(model.net2.parameters()) + list(model.out.parameters())})
    assert opt.param_groups is opt.optim.param_groups and len(opt.param_groups) == 2
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(2, 10) + rank).sum().backward()
        opt.step()
    assert opt.state is opt.optim.state and repr(opt) == repr(opt.optim)
    saved = opt.state_dict()
    fresh = PostLocalSGDOptimizer(torch.optim.SGD(list(model.net1.parameters()), lr=LR, momentum=0.9),
                                  averagers.PeriodicModelAverager(period=2))
    fresh.add_param_group({"params": list(model.net2.parameters()) + list(model.out.parameters())})
    fresh.load_state_dict(saved)
    without_step = dict(saved)
    del without_step["step"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other = PostLocalSGDOptimizer(torch.optim.SGD(list(model.net1.parameters()), lr=LR, momentum=0.9),
                                      averagers.PeriodicModelAverager(period=2))
        other.add_param_group({"params": list(model.net2.parameters()) + list(model.out.parameters())})
        other.averager.step = 5
        other.load_state_dict(without_step)
    opt.zero_grad()
    return {"step": saved["step"], "fresh_step": fresh.averager.step, "other_step": other.averager.step,
            "warning": str(caught[-1].message), "grads_none": all(p.grad is None for p in model.parameters()),
            "momentum_loaded": all(torch.equal(fresh.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer"])
                                   for p in model.parameters()),
            "params": _snapshot(model)}


def test_post_local_sgd_optimizer_state_dict_and_param_groups():
    results = run_ranks(_optimizer_api, 2, backend="gloo")
    for r in results:
        assert r["step"] == 3 and r["fresh_step"] == 3 and r["other_step"] == 0
        assert r["warning"] == ("Loaded state dict does not contain a step counter for an averager. "
                                "Setting step counter to 0.")
        assert r["grads_none"] and r["momentum_loaded"]
    # steps 0 and 2 averaged: the last step averaged, so the ranks agree
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


# -- the same program on torch.distributed ----------------------------------------------------------------------

def _like_torch(rank, world_size, hierarchical):
    import torch.distributed as torch_dist
    import torch.distributed.algorithms.model_averaging.hierarchical_model_averager as torch_hierarchical
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_post_localSGD
    from torch.distributed.algorithms.model_averaging import averagers as torch_averagers
    from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    port = [free_port() if rank == 0 else None]
    torchdist.broadcast_object_list(port)
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port[0]}", rank=rank,
                                  world_size=world_size)
    impls = (("torch", torch_dist, TorchDDP, torch_post_localSGD, torch_averagers, torch_hierarchical,
              TorchPostLocalSGDOptimizer),
             ("torchdist", torchdist, DDP, post_localSGD, averagers, hierarchical_model_averager,
              PostLocalSGDOptimizer))
    results = {}
    for name, dist, ddp_class, hooks, averagers_, hierarchical_, optimizer_class in impls:
        subgroup, _ = dist.new_subgroups(group_size=2 if world_size % 2 == 0 else 1)
        ddp = ddp_class(build("mlp"))
        ddp.register_comm_hook(hooks.PostLocalSGDState(None, subgroup, 2), hooks.post_localSGD_hook)
        if hierarchical:
            averager = hierarchical_.HierarchicalModelAverager(OrderedDict([(2, 2), (3, world_size)]),
                                                               warmup_steps=2)
        else:
            averager = averagers_.PeriodicModelAverager(period=2, warmup_steps=2)
        opt = optimizer_class(torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9), averager)
        results[name] = (_train(ddp, opt, rank, world_size), opt.state_dict()["step"])
    torch_dist.destroy_process_group()
    return results


@pytest.mark.parametrize("world_size,hierarchical", [(2, False), (3, False), (4, True)])
def test_same_parameters_as_torch_distributed(world_size, hierarchical):
    results = run_ranks(_like_torch, world_size, args=(hierarchical,), backend="gloo",
                        env={"GLOO_SOCKET_IFNAME": "lo"}, timeout=120)
    for result in results:
        got, want = result["torchdist"], result["torch"]
        assert got[1] == want[1] == STEPS
        for step, (g, w) in enumerate(zip(got[0], want[0])):
            for a, b in zip(g, w):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=lambda m: f"step {step}: {m}")
