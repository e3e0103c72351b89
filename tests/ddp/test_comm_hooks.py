"""register_comm_hook, GradBucket and the built-in hooks (inventory 75-76)."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torchdist.algorithms import ddp_comm_hooks
from torchdist.algorithms.ddp_comm_hooks import (
    DDPCommHookType,
    PowerSGDState,
    batched_powerSGD_hook,
    default_hooks,
    powerSGD_hook,
    register_ddp_comm_hook,
)
from torchdist.nn.parallel import DistributedDataParallel as DDP
from torchdist._ddp.bucket import GradBucket
from torchdist.testing import free_port, run_ranks

from ._common import LR, TOL, assert_close_states, build, full_batches, shard, state, train_reference


def _twos(state_, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    fut = torch.futures.Future()
    fut.set_result(2 * torch.ones_like(bucket.buffer()))
    return fut


def _hook_value(rank, world_size):
    ddp = DDP(build("mlp"))
    ddp.register_comm_hook(None, _twos)
    ddp(torch.randn(3, 10)).sum().backward()
    return [p.grad.clone() for p in ddp.parameters()]


def test_hook_future_value_becomes_the_gradient():
    for grads in run_ranks(_hook_value, 2, backend="gloo"):
        for g in grads:
            assert torch.equal(g, 2 * torch.ones_like(g))


def _hook_fails_once_then_trains(rank, world_size, longer):
    calls = []

    def flaky(state_, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        calls.append(bucket.index())
        if len(calls) == 1:
            fut = torch.futures.Future()
            fut.set_exception(ValueError("transient failure"))
            return fut
        averaged = default_hooks.allreduce_hook(None, bucket)
        if longer:  # a longer result gives its leading elements, as in PyTorch
            return averaged.then(lambda f: torch.cat([f.value(), torch.full((3,), 7.0)]))
        return averaged

    ddp = DDP(build("mlp"))
    ddp.register_comm_hook(None, flaky)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    batches = full_batches("mlp", world_size, 4)
    with pytest.raises(ValueError, match="transient failure"):
        F.cross_entropy(ddp(shard(batches[0][0], rank)), shard(batches[0][1], rank)).backward()
    for x, y in batches[1:]:
        opt.zero_grad()
        F.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()
        opt.step()
    return state(ddp)


@pytest.mark.parametrize("longer", [False, True], ids=["same-size", "longer-result"])
def test_a_failed_hook_future_fails_its_iteration_only(longer):
    """The next forward raised "Expected to have finished reduction" for ever after."""
    model = build("mlp")  # the reference skips the failed step
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in full_batches("mlp", 2, 4)[1:]:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    want = state(model)
    for got in run_ranks(_hook_fails_once_then_trains, 2, args=(longer,), backend="gloo"):
        assert_close_states(got, want)


def _train_with_hook(rank, world_size, hook_type, steps):
    ddp = DDP(build("mlp"), bucket_cap_mb=0.002)
    register_ddp_comm_hook(DDPCommHookType[hook_type], ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for x, y in full_batches("mlp", world_size, steps):
        opt.zero_grad()
        F.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()
        opt.step()
    return state(ddp)


@pytest.mark.parametrize("hook_type,tol", [
    ("ALLREDUCE", TOL), ("FP16_COMPRESS", {"rtol": 1e-2, "atol": 2e-3}), ("BF16_COMPRESS", {"rtol": 2e-2, "atol": 1e-2}),
    # 8-bit gradients (tests/ddp/test_quantization_hooks.py checks their values exactly)
    ("QUANTIZE_PER_TENSOR", {"rtol": 0, "atol": 2e-3}), ("QUANTIZE_PER_CHANNEL", {"rtol": 0, "atol": 2e-3}),
])
@pytest.mark.parametrize("world_size", [2, 3])
def test_builtin_hooks_match_plain_ddp(hook_type, tol, world_size):
    results = run_ranks(_train_with_hook, world_size, args=(hook_type, 3), backend="gloo")
    want = train_reference("mlp", world_size, 3)
    for got in results:
        assert_close_states(got, want, **tol)
        for k in got:
            assert torch.equal(got[k], results[0][k]), f"replicas differ in {k}"


def _power_sgd(rank, world_size, start_iter, batched, steps):
    ddp = DDP(build("mlp"))
    hook = batched_powerSGD_hook if batched else powerSGD_hook.powerSGD_hook
    ps = PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=start_iter,
                       min_compression_rate=1.0)
    ddp.register_comm_hook(ps, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for x, y in full_batches("mlp", world_size, steps):
        opt.zero_grad()
        F.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()
        opt.step()
    return state(ddp), ps.iter, ps.compression_stats()


@pytest.mark.parametrize("batched", [False, True])
def test_power_sgd_before_start_is_plain_allreduce(batched):
    results = run_ranks(_power_sgd, 2, args=(10, batched, 3), backend="gloo")
    assert_close_states(results[0][0], train_reference("mlp", 2, 3))
    assert results[0][1] == 3


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("world_size", [2, 3])
def test_power_sgd_compresses_and_keeps_replicas_identical(batched, world_size):
    results = run_ranks(_power_sgd, world_size, args=(2, batched, 5), backend="gloo")
    first, iters, (rate, before, after) = results[0]
    assert iters == 5 and rate > 1 and after < before, (iters, rate, before, after)
    if batched:  # PyTorch's counts: the bucket's elements, not its padded square (3 compressed steps)
        numel = sum(p.numel() for p in build("mlp").parameters())
        side = math.ceil(math.sqrt(numel))
        assert (before, after) == (3 * numel, 3 * side * 2 * 2), (before, after)
    want = train_reference("mlp", world_size, 5)
    for got, _, _ in results:
        for k in got:
            assert torch.equal(got[k], first[k]), f"replicas differ in {k}"
    # low-rank gradients still move the model close to full-gradient SGD in a few steps
    assert_close_states(first, want, rtol=0, atol=0.1)


def _power_sgd_many_buckets(rank, world_size, batched, warm_start):
    torch.manual_seed(0)
    # two 600 x 600 weights of 1.44 MB: buckets of their own, three buckets in all
    model = nn.Sequential(nn.Linear(16, 600), nn.ReLU(), nn.Linear(600, 600), nn.ReLU(), nn.Linear(600, 600),
                          nn.ReLU(), nn.Linear(600, 4))
    ddp = DDP(model)
    ddp.register_comm_hook(PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                         warm_start=warm_start),
                           batched_powerSGD_hook if batched else powerSGD_hook.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(6):
        opt.zero_grad()
        ddp(torch.randn(8, 16, generator=generator)).pow(2).mean().backward()
        opt.step()
    return state(ddp), len(ddp._get_ddp_logging_data()["bucket_sizes"])


@pytest.mark.parametrize("backend", ["tcp", "gloo"])
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("warm_start", [True, False], ids=["warm-start", "fresh-q"])
def test_power_sgd_with_several_buckets_keeps_ranks_in_step(backend, batched, warm_start):
    # PyTorch's hook issues its P and Q all-reduces from future callbacks, which race
    # the next bucket's hook: with several buckets, ranks paired different collectives
    # (torchdist raised a mismatch; gloo hangs). Without warm start, a bucket's
    # decompression clears the P and Q memory while the next bucket's hook uses its own
    # (it raised KeyError).
    (first, buckets), (second, _) = run_ranks(_power_sgd_many_buckets, 2, args=(batched, warm_start),
                                              backend=backend, timeout=90)
    assert buckets >= 2
    for k in first:
        assert torch.equal(first[k], second[k]), f"replicas differ in {k}"


def test_power_sgd_start_iter_validation_and_pickling():
    with pytest.raises(ValueError, match="start_powerSGD_iter"):
        PowerSGDState(None, start_powerSGD_iter=1)
    PowerSGDState(None, start_powerSGD_iter=1, use_error_feedback=False, warm_start=False)
    with pytest.raises(ValueError, match="Default process group has not been initialized"):
        pickle.loads(pickle.dumps(PowerSGDState(None)))  # it becomes the default group, as in PyTorch


def _power_sgd_like_torch(rank, world_size):
    """The same training with torch's DDP and PowerSGD hook, then with torchdist's."""
    import torch.distributed as torch_dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_power_sgd
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import torchdist

    port = [free_port() if rank == 0 else None]
    torchdist.broadcast_object_list(port)
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port[0]}", rank=rank,
                                  world_size=world_size)
    results = {}
    for name, ddp_class, hooks in (("torch", TorchDDP, torch_power_sgd), ("torchdist", DDP, powerSGD_hook)):
        ddp = ddp_class(build("mlp"))
        power_sgd = hooks.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                        random_seed=7)
        ddp.register_comm_hook(power_sgd, hooks.powerSGD_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
        for x, y in full_batches("mlp", world_size, 5):
            opt.zero_grad()
            F.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()
            opt.step()
        results[name] = state(ddp)
        state_after = pickle.loads(pickle.dumps(power_sgd))  # the default group is initialized now
        assert state_after.process_group is not None and state_after.iter == 5
    torch_dist.destroy_process_group()
    return results


def test_power_sgd_draws_the_same_random_q_as_pytorchs_hook():
    """Same seed, same Qs (numpy-seeded, as in PyTorch): the trained models agree to rounding
    (with random.Random's seeds they differed by up to 2.4e-3 here)."""
    for result in run_ranks(_power_sgd_like_torch, 2, backend="gloo", env={"GLOO_SOCKET_IFNAME": "lo"}):
        assert_close_states(result["torchdist"], result["torch"], prefix="", rtol=0, atol=1e-5)


def _bad_hooks(rank, world_size):
    ddp = DDP(build("mlp"))
    errors = {}
    try:
        ddp.register_comm_hook(None, 3)
    except TypeError as exc:
        errors["not_callable"] = ("TypeError", str(exc))

    def annotated(state, bucket: int):
        return None

    def bad_return(state, bucket) -> int:
        return 0

    for name, hook in [("bucket_annotation", annotated), ("return_annotation", bad_return)]:
        try:
            ddp.register_comm_hook(None, hook)
        except Exception as exc:  # noqa: BLE001
            errors[name] = (type(exc).__name__, str(exc))
    ddp.register_comm_hook(None, lambda s, bucket: bucket.buffer())  # returns a tensor, not a future
    try:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    except RuntimeError as exc:
        errors["twice"] = ("RuntimeError", str(exc))
    try:
        ddp(torch.randn(2, 10)).sum().backward()
    except RuntimeError as exc:
        errors["not_future"] = ("RuntimeError", str(exc))
    return errors


def test_misused_hooks_raise_pytorch_errors():
    errors = run_ranks(_bad_hooks, 2, backend="gloo")[0]
    assert errors["not_callable"] == ("TypeError", "Communication hook must be callable.")
    assert errors["bucket_annotation"][0] == "ValueError"
    assert "bucket annotation should be dist.GradBucket." in errors["bucket_annotation"][1]
    assert errors["return_annotation"][0] == "ValueError"
    assert errors["twice"][1] == "register_comm_hook or register_builtin_comm_hook can only be called once."
    assert "callback must return a torch.futures.Future object, but got" in errors["not_future"][1]


def test_hook_types_cover_the_builtins():
    assert {t.name for t in DDPCommHookType} >= {"ALLREDUCE", "FP16_COMPRESS", "BF16_COMPRESS", "POWER_SGD", "NOOP"}
    assert callable(ddp_comm_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook))
    assert (ddp_comm_hooks.default, ddp_comm_hooks.debugging) == (default_hooks, ddp_comm_hooks.debugging_hooks)


def test_hook_type_values_register_their_hook_when_called_as_in_pytorch():
    """PyTorch documents ``DDPCommHookType.X.value(model=..., state=...)``: the values are callables."""
    class Model:
        def register_comm_hook(self, state, hook):
            self.registered = (state, hook)

    model = Model()
    DDPCommHookType.FP16_COMPRESS.value(model=model, state="group")
    assert model.registered == ("group", default_hooks.fp16_compress_hook)
    DDPCommHookType.BATCHED_POWER_SGD_RANK2.value(model=model, state=None)
    state, hook = model.registered
    assert hook is ddp_comm_hooks.powerSGD.batched_powerSGD_hook
    assert (state.matrix_approximation_rank, state.start_powerSGD_iter) == (2, 1_000)
