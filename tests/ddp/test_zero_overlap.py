"""ZeroRedundancyOptimizer(overlap_with_ddp=True) stepped by ddp_zero_hook's hooks.

Every overlapped run is compared with plain DDP and the plain optimizer on the same
data, which skips the steps of the warm-up iterations (2, or 3 with static_graph),
and, for ``hook_with_zero_step``, with PyTorch's own overlapped run on gloo (PyTorch
refuses gloo for these hooks; the tests lift that check to get a reference, which
works for the non-interleaved hook; its interleaved one hangs on gloo).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from torchdist.algorithms.ddp_comm_hooks import allreduce_hook, fp16_compress_wrapper
from torchdist.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step, hook_with_zero_step_interleaved
from torchdist.nn.parallel import DistributedDataParallel as DDP
from torchdist.optim import ZeroRedundancyOptimizer
from torchdist.testing import free_port, run_ranks

from ._common import TOL, build, full_batches, shard, state

# Bucket caps for the mlp (weights of 640 B, 4 KB and 1.25 KB, biases): with 1 KB the two larger
# weights get solo buckets and the rest shares one (3 buckets); with 4 KB the buckets are
# [out, net2.bias, net2.weight] and [net1]: shard_buckets splits the first over two ranks.
CAP_MB = 0.001
SHARDED_CAP_MB = 0.004
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), "adam": (torch.optim.Adam, {"lr": 0.01})}
HOOKS = {"step": hook_with_zero_step, "interleaved": hook_with_zero_step_interleaved}
STEPS = 6


def _changed(before: list[torch.Tensor], module: torch.nn.Module) -> bool:
    return any(not torch.equal(a, b) for a, b in zip(before, module.parameters()))


def _overlapped(rank, world_size, hook_name, shard_buckets, opt_name, static_graph=False, steps=STEPS, cap=None,
                as_view=False):
    """Train with the step inside DDP's hook; the model and which iterations changed it."""
    opt_class, kwargs = OPTIMIZERS[opt_name]
    cap = cap or (SHARDED_CAP_MB if shard_buckets else CAP_MB)
    ddp = DDP(build("mlp"), bucket_cap_mb=cap, static_graph=static_graph, gradient_as_bucket_view=as_view)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), opt_class, overlap_with_ddp=True, **kwargs)
    ddp.register_comm_hook(None, HOOKS[hook_name](allreduce_hook, ddp, zero, shard_buckets=shard_buckets))
    changed = []
    for x, y in full_batches("mlp", world_size, steps):
        before = [p.detach().clone() for p in ddp.parameters()]
        zero.zero_grad()
        F.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()
        changed.append(_changed(before, ddp))
    return state(ddp), changed, zero, ddp


def _plain(rank, world_size, opt_name, warmup, steps=STEPS):
    """Plain DDP and the plain optimizer, skipping the steps of the first ``warmup`` iterations."""
    opt_class, kwargs = OPTIMIZERS[opt_name]
    ddp = DDP(build("mlp"), bucket_cap_mb=CAP_MB)
    opt = opt_class(ddp.parameters(), **kwargs)
    for i, (x, y) in enumerate(full_batches("mlp", world_size, steps)):
        opt.zero_grad()
        F.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()
        if i >= warmup:
            opt.step()
    return state(ddp), opt


def _compare(rank, world_size, hook_name, shard_buckets, opt_name, static_graph, **kwargs):
    got, changed, zero, ddp = _overlapped(rank, world_size, hook_name, shard_buckets, opt_name, static_graph,
                                          **kwargs)
    want, _ = _plain(rank, world_size, opt_name, warmup=3 if static_graph else 2)
    assignments = sorted(zero._bucket_assignments_per_rank[rank])
    return got, want, changed, assignments, len(ddp.reducer.buckets)


def _check(results, warmup):
    owned = []
    for got, want, changed, assignments, _ in results:
        assert changed == [False] * warmup + [True] * (STEPS - warmup), changed
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, **TOL)
        owned.extend(assignments)
    torch.testing.assert_close(results[0][0], results[-1][0], rtol=0, atol=0)  # replicas identical
    return owned


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
@pytest.mark.parametrize("shard_buckets", [False, True])
@pytest.mark.parametrize("hook_name", ["step", "interleaved"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_overlapped_step_matches_plain_ddp_and_optimizer(world_size, hook_name, shard_buckets, opt_name):
    results = run_ranks(_compare, world_size, args=(hook_name, shard_buckets, opt_name, False), backend="gloo")
    owned = _check(results, warmup=2)
    num_buckets = results[0][4]
    if shard_buckets:  # every bucket stepped, the large one by two ranks
        assert num_buckets == 2 and set(owned) == {0, 1} and len(owned) == 3, owned
    else:  # whole buckets round robin
        assert num_buckets == 3 and sorted(owned) == [0, 1, 2]
        assert results[1][3] == list(range(1, num_buckets, world_size))


@pytest.mark.parametrize("hook_name", ["step", "interleaved"])
def test_world_size_one(hook_name):
    _check(run_ranks(_compare, 1, args=(hook_name, False, "adam", False), backend="gloo"), warmup=2)


@pytest.mark.parametrize("hook_name", ["step", "interleaved"])
def test_static_graph_updates_from_the_fourth_iteration(hook_name):
    _check(run_ranks(_compare, 2, args=(hook_name, True, "sgd", True), backend="gloo"), warmup=3)


@pytest.mark.parametrize("hook_name", ["step", "interleaved"])
def test_a_rank_without_buckets_and_gradient_as_bucket_view(hook_name):
    """Two whole buckets over three ranks: rank 2 steps nothing and only receives."""
    results = run_ranks(_compare, 3, args=(hook_name, False, "adam", False),
                        kwargs={"cap": SHARDED_CAP_MB, "as_view": True}, backend="gloo")
    _check(results, warmup=2)
    assert [r[3] for r in results] == [[0], [1], []]


# -- against PyTorch's own overlapped run -------------------------------------------------------------
def _like_torch(rank, world_size, opt_name, shard_buckets, static_graph):
    """PyTorch's DDP + ZeRO + hook_with_zero_step on gloo (its gloo refusal lifted), then torchdist's."""
    import torch.distributed as torch_dist
    from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook as torch_zero_hook
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import torchdist

    port = [free_port() if rank == 0 else None]
    torchdist.broadcast_object_list(port)
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port[0]}", rank=rank,
                                  world_size=world_size)
    opt_class, kwargs = OPTIMIZERS[opt_name]
    ddp = TorchDDP(build("mlp"), bucket_cap_mb=SHARDED_CAP_MB if shard_buckets else CAP_MB,
                   static_graph=static_graph)
    zero = TorchZeRO(ddp.parameters(), opt_class, overlap_with_ddp=True, **kwargs)
    get_backend = torch_dist.get_backend
    torch_dist.get_backend = lambda group=None: "nccl"  # "Gloo backend using Overlapping DDP with ZeRO may meet hangs"
    try:
        hook = torch_zero_hook.hook_with_zero_step(torch_hooks.allreduce_hook, ddp, zero, shard_buckets=shard_buckets)
    finally:
        torch_dist.get_backend = get_backend
    ddp.register_comm_hook(None, hook)
    changed = []
    for x, y in full_batches("mlp", world_size, STEPS):
        before = [p.detach().clone() for p in ddp.parameters()]
        zero.zero_grad()
        F.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()
        changed.append(_changed(before, ddp))
    theirs = state(ddp), changed
    torch_dist.destroy_process_group()
    ours = _overlapped(rank, world_size, "step", shard_buckets, opt_name, static_graph)[:2]
    return ours, theirs


@pytest.mark.parametrize("opt_name,shard_buckets,static_graph",
                         [("sgd", False, False), ("adam", True, False), ("adam", False, True)])
@pytest.mark.parametrize("world_size", [2, 3])
def test_same_parameters_as_pytorchs_overlap(world_size, opt_name, shard_buckets, static_graph):
    results = run_ranks(_like_torch, world_size, args=(opt_name, shard_buckets, static_graph), backend="gloo",
                        env={"GLOO_SOCKET_IFNAME": "lo"}, timeout=120)
    for (ours, ours_changed), (theirs, theirs_changed) in results:
        assert ours_changed == theirs_changed, (ours_changed, theirs_changed)
        for k, v in theirs.items():
            torch.testing.assert_close(ours[k], v, **TOL)


# -- schedule ----------------------------------------------------------------------------------------
def _schedule(rank, world_size, hook_name):
    """Events of the last iteration on this rank: ("AR", bucket) when a bucket's hook runs,
    ("step", n) when the local optimizer steps (n: hooks run so far)."""
    ddp = DDP(build("mlp"), bucket_cap_mb=CAP_MB)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    events: list[tuple[str, int]] = []

    def recording_hook(state, bucket):
        events.append(("AR", bucket.index()))
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, HOOKS[hook_name](recording_hook, ddp, zero))
    for x, y in full_batches("mlp", world_size, 4):
        events.clear()
        F.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()
        if zero._overlap_info.status == 2:  # INITIALIZED: record the optimizer's steps too
            step = zero.optim.step
            zero.optim.step = lambda *a, **k: (events.append(("step", sum(e[0] == "AR" for e in events))),
                                               step(*a, **k))[1]
    return events, sorted(zero._bucket_assignments_per_rank[rank])


@pytest.mark.parametrize("hook_name", ["step", "interleaved"])
def test_schedule_of_steps_and_all_reduces(hook_name):
    """The non-interleaved hook steps after the last all-reduce; the interleaved one steps
    bucket i - 1 in the hook of bucket i, after issuing bucket i's all-reduce."""
    for events, mine in run_ranks(_schedule, 2, args=(hook_name,), backend="gloo"):
        buckets = [b for kind, b in events if kind == "AR"]
        steps = [n for kind, n in events if kind == "step"]
        assert buckets == list(range(len(buckets))) and len(buckets) >= 3
        if hook_name == "step":
            assert steps == [len(buckets)] * len(mine)
        else:  # bucket b is stepped once b + 1 hooks ran (the last bucket in its own hook)
            assert steps == [min(b + 2, len(buckets)) for b in mine]


# -- state dicts ---------------------------------------------------------------------------------------
def _state_dicts(rank, world_size, shard_buckets):
    _, _, zero, _ = _overlapped(rank, world_size, "interleaved", shard_buckets, "adam")
    _, plain = _plain(rank, world_size, "adam", warmup=2)
    zero.consolidate_state_dict(to=1)
    full = zero.state_dict() if rank == 1 else None
    error = None
    if rank != 1:
        try:
            zero.state_dict()
        except RuntimeError as exc:
            error = str(exc)
    # loaded on every rank, then consolidated again: the same state
    everywhere = [full]
    from torchdist import broadcast_object_list
    broadcast_object_list(everywhere, src=1)
    zero.load_state_dict(everywhere[0])
    zero.consolidate_state_dict(to=0)
    again = zero.state_dict() if rank == 0 else None
    return full, plain.state_dict(), error, again, len(zero.optim.state)


@pytest.mark.parametrize("shard_buckets", [False, True])
def test_consolidated_state_dict_is_the_plain_optimizers(shard_buckets):
    results = run_ranks(_state_dicts, 2, args=(shard_buckets,), backend="gloo")
    full, want = results[1][0], results[1][1]
    assert [g["params"] for g in full["param_groups"]] == [g["params"] for g in want["param_groups"]]
    assert full["param_groups"][0]["lr"] == want["param_groups"][0]["lr"]
    assert sorted(full["state"]) == sorted(want["state"])
    for i, s in want["state"].items():
        for key, value in s.items():
            torch.testing.assert_close(full["state"][i][key], value, **TOL)
    assert "consolidate_state_dict(to=0)" in results[0][2]
    again = results[0][3]
    for i, s in full["state"].items():
        for key, value in s.items():
            torch.testing.assert_close(again["state"][i][key], value, rtol=0, atol=0)
    assert sum(r[4] for r in results) == len(want["state"]), "each parameter's state lives on one rank"


# -- misuse ----------------------------------------------------------------------------------------------
def _error(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test compares type and message
        return type(exc).__name__, str(exc)
    return None


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _misuse(rank, world_size):
    records = _Records()
    logging.getLogger("torchdist.optim.zero_redundancy_optimizer").addHandler(records)
    ddp = DDP(build("mlp"), bucket_cap_mb=CAP_MB)
    params = list(ddp.parameters())
    errors = {}
    plain = ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1)
    errors["not_overlap"] = _error(lambda: hook_with_zero_step(allreduce_hook, ddp, plain))
    errors["not_overlap_interleaved"] = _error(lambda: hook_with_zero_step_interleaved(allreduce_hook, ddp, plain))
    errors["no_functional_twin"] = _error(
        lambda: ZeroRedundancyOptimizer(params, torch.optim.LBFGS, overlap_with_ddp=True, lr=0.1))
    errors["two_groups"] = _error(lambda: ZeroRedundancyOptimizer(
        [{"params": params[:2]}, {"params": params[2:]}], torch.optim.SGD, overlap_with_ddp=True, lr=0.1))
    zero = ZeroRedundancyOptimizer(params, torch.optim.SGD, overlap_with_ddp=True, lr=0.1,
                                   parameters_as_bucket_view=True)
    errors["add_param_group"] = _error(lambda: zero.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))]}))
    errors["consolidate_early"] = _error(zero.consolidate_state_dict)
    errors["state_dict_early"] = _error(zero.state_dict)
    errors["load_early"] = _error(lambda: zero.load_state_dict({"state": {}, "param_groups": []}))
    errors["step"] = zero.step()
    return errors, records.messages


def test_misuse_raises_pytorchs_errors_and_step_is_a_no_op():
    errors, messages = run_ranks(_misuse, 2, backend="gloo")[0]
    not_overlap = ("ValueError", "ZeroRedundancyOptimizer must be constructed with `overlap_with_ddp=True` to use "
                   "this hook properly")
    assert errors["not_overlap"] == errors["not_overlap_interleaved"] == not_overlap
    assert errors["no_functional_twin"][0] == "ValueError"
    assert errors["no_functional_twin"][1].startswith("Using `ddp_with_overlap=True` requires using a functional "
                                                      "optimizer, but there is no supported functional optimizer "
                                                      "equivalent for <class 'torch.optim.lbfgs.LBFGS'>")
    single = ("RuntimeError", "ZeroRedundancyOptimizer with `overlap_with_ddp=True` only supports a single parameter "
              "group")
    assert errors["two_groups"] == errors["add_param_group"] == single
    early = ("RuntimeError", "This method should not be called until this ZeroRedundancyOptimizer instance has been "
             "fully initialized")
    assert errors["consolidate_early"] == errors["state_dict_early"] == errors["load_early"] == early
    assert errors["step"] is None
    assert "`step()` should not be included in the training loop when `overlap_with_ddp=True`" in messages
    assert any(m.startswith("`parameters_as_bucket_view=True` will be ignored") for m in messages)


def _compressed(rank, world_size, hook_name, overlap):
    """fp16_compress_wrapper(allreduce_hook): the bucket the hook sees is a float16 copy; the
    step must use the float32 gradients of the hook's result, as DDP writes them to ``.grad``."""
    ddp = DDP(build("mlp"), bucket_cap_mb=CAP_MB)
    hook = fp16_compress_wrapper(allreduce_hook)
    if overlap:
        opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
        hook = HOOKS[hook_name](hook, ddp, opt)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ddp.register_comm_hook(None, hook)
    for i, (x, y) in enumerate(full_batches("mlp", world_size, 4)):
        opt.zero_grad()
        F.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()
        if not overlap and i >= 2:
            opt.step()
    return state(ddp)


@pytest.mark.parametrize("hook_name", ["step", "interleaved"])
def test_wrapped_hook_with_a_result_of_its_own(hook_name):
    got = run_ranks(_compressed, 2, args=(hook_name, True), backend="gloo")
    want = run_ranks(_compressed, 2, args=(hook_name, False), backend="gloo")
    for k, v in want[0].items():
        torch.testing.assert_close(got[0][k], v, **TOL)


def _run_time_errors(rank, world_size, case):
    """Errors PyTorch raises once the overlap is initialized, during backward."""
    ddp = DDP(build("mlp"), bucket_cap_mb=CAP_MB)
    params = list(ddp.parameters())
    # "trainability": a parameter outside DDP (freezing one of DDP's would stall its bucket)
    extra = torch.nn.Parameter(torch.ones(3))
    zero = ZeroRedundancyOptimizer(params[1:] if case == "subset" else params + [extra], torch.optim.SGD,
                                   overlap_with_ddp=True, lr=0.1)
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    for i, (x, y) in enumerate(full_batches("mlp", world_size, 4)):
        if case == "trainability" and i == 3:
            extra.requires_grad_(False)
        try:
            F.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()
        except (RuntimeError, ValueError) as exc:
            return i, type(exc).__name__, str(exc)
    return None


def test_run_time_errors():
    subset = run_ranks(_run_time_errors, 2, args=("subset",), backend="gloo")
    assert subset[0] == (2, "ValueError", "Passing a new parameter in `params_per_rank` that was not passed into "
                                          "the ZeroRedundancyOptimizer constructor")
    trainability = run_ranks(_run_time_errors, 1, args=("trainability",), backend="gloo")
    assert trainability[0] == (3, "RuntimeError", "ZeroRedundancyOptimizer with `overlap_with_ddp=True` does not "
                                                  "support changing parameter trainability at run time")


def _find_unused(rank, world_size):
    ddp = DDP(build("mlp"), bucket_cap_mb=CAP_MB, find_unused_parameters=True)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    with pytest.warns(UserWarning, match="never rebuilds its buckets"):
        ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    changed = []
    for x, y in full_batches("mlp", world_size, 5):
        before = [p.detach().clone() for p in ddp.parameters()]
        F.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()
        changed.append(_changed(before, ddp))
    return changed


def test_find_unused_parameters_never_updates_as_in_pytorch():
    """PyTorch's DDP never rebuilds its buckets with find_unused_parameters, so its ZeRO never
    initializes (checked with torch 2.13 on gloo); torchdist does the same, and warns."""
    for changed in run_ranks(_find_unused, 2, backend="gloo"):
        assert changed == [False] * 5
