"""Bucket layout and the solo-bucket path: large gradients are reduced in place, not copied."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torchdist._ddp.bucket import assign_buckets
from torchdist._ddp.config import DDPConfig
from torchdist.nn.parallel import DistributedDataParallel as DDP
from torchdist.testing import run_ranks

from ._common import LR, TOL, assert_close_states, build, full_batches, shard, state, train_reference

# bucket_cap_mb giving a 2 KiB-ish limit: the test models' 32x32 weights (4 KiB) get solo buckets
TINY_CAP_MB = 0.002


def _params(*numels: int, dtype=torch.float32) -> list[torch.Tensor]:
    return [torch.zeros(n, dtype=dtype) for n in numels]


def test_assign_buckets_solo_then_coalesced_leftovers():
    # bytes: 0: 40, 1: 400, 2: 4000, 3: 40, 4: 4000; walked backwards, limits 1000 then 2000
    params = _params(10, 100, 1000, 10, 1000)
    layout = assign_buckets(params, [4, 3, 2, 1, 0], [1000, 2000], solo_bytes=1 << 20)
    assert layout == [([4], True), ([2], True), ([3, 1, 0], False)]


def test_assign_buckets_coalesced_bucket_closes_at_its_limit():
    # 400 bytes each, then 4000: 0 + 1 + 2 reach the first limit (1000); 4 fills the second (2000)
    # on its own, so it is solo and closed before the bucket that 3 opened
    params = _params(100, 100, 100, 100, 1000)
    layout = assign_buckets(params, [0, 1, 2, 3, 4], [1000, 2000], solo_bytes=1 << 20)
    assert layout == [([0, 1, 2], False), ([4], True), ([3], False)]


def test_assign_buckets_without_solo_is_pytorch_layout():
    params = _params(10, 100, 1000, 10, 1000)
    layout = assign_buckets(params, [4, 3, 2, 1, 0], [1000, 2000], solo_bytes=None)
    assert layout == [([4], False), ([3, 2], False), ([1, 0], False)]


def test_assign_buckets_solo_threshold_and_dtypes():
    params = _params(300, 200) + _params(300, dtype=torch.float64)
    # 1200 and 800 float32 bytes, 2400 float64 bytes; solo from 1000 bytes whatever the limit
    layout = assign_buckets(params, [0, 1, 2], [10_000], solo_bytes=1000)
    assert layout == [([0], True), ([2], True), ([1], False)]


def test_config_rejects_non_positive_solo_bytes():
    with pytest.raises(ValueError, match="solo_param_bytes must be positive, got 0"):
        DDPConfig(solo_param_bytes=0)


def test_a_small_first_bucket_only_with_the_default_cap_as_in_pytorch():
    assert DDPConfig().size_limits() == [1 << 20, 25 << 20]  # PyTorch's _DEFAULT_FIRST_BUCKET_BYTES
    assert DDPConfig(bucket_cap_mb=4, first_bucket_bytes=None).size_limits() == [4 << 20]


def _layout_with_cap(rank, world_size, cap_mb):
    model = nn.Sequential(*(nn.Linear(256, 256, bias=False) for _ in range(7)))  # 256 KiB weights
    return DDP(model, bucket_cap_mb=cap_mb)._get_ddp_logging_data()["bucket_sizes"]


def test_a_cap_the_user_chose_applies_to_the_first_bucket():
    # 1.75 MiB of gradients and a chosen 1.5 MiB cap: the first bucket closes at 1.5 MiB
    # (six weights), as PyTorch's does, not at the 1 MiB of the default cap's first bucket.
    [sizes] = run_ranks(_layout_with_cap, 1, args=(1.5,), backend="gloo", timeout=60)
    assert sizes == [1536 << 10, 256 << 10]


def _in_place(rank, world_size, set_to_none):
    model = build("mlp")
    produced = {}  # parameter name -> data_ptr of the .grad autograd produced, seen before DDP's hook
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: produced.__setitem__(name, p.grad.data_ptr()))
    ddp = DDP(model, bucket_cap_mb=TINY_CAP_MB)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    solo_names = {n for n, p in model.named_parameters()
                  if any(b.solo and b.params[0] is p for b in ddp.reducer.buckets)}
    same_storage = []
    for x, y in full_batches("mlp", world_size, 3):
        opt.zero_grad(set_to_none=set_to_none)
        F.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()
        same_storage.append({n: p.grad.data_ptr() == produced[n] for n, p in model.named_parameters()})
        opt.step()
    return state(ddp), solo_names, same_storage, ddp._get_ddp_logging_data()["solo_buckets"]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_solo_buckets_reduce_the_grad_in_place(set_to_none):
    results = run_ranks(_in_place, 2, args=(set_to_none,), backend="gloo")
    want = train_reference("mlp", 2, 3)
    for got, solo_names, same_storage, solo_buckets in results:
        assert_close_states(got, want)
        assert solo_names == {"net2.weight"}, solo_names  # 4 KiB; the others are under the 2 KiB limit
        assert len(solo_buckets) == 1
        for step in same_storage:  # every .grad is still the tensor autograd produced (no bucket view)
            assert all(step.values()), step


def _symmetric_buckets(rank, world_size, as_view):
    import torchdist
    ddp = DDP(build("wide"), gradient_as_bucket_view=as_view)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    symmetric = []
    for x, y in full_batches("wide", world_size, 3):
        opt.zero_grad()
        F.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()
        opt.step()
        symmetric.append([torchdist.symmetric_memory.is_symmetric(b.buffer) for b in ddp.reducer.buckets])
    return state(ddp), symmetric


@pytest.mark.parametrize("world_size, as_view", [(2, False), (3, False), (2, True)])
def test_coalesced_buckets_live_in_symmetric_memory_on_shm(world_size, as_view):
    """A coalesced bucket over 128 KiB is allocated in the group's symmetric memory, so its
    all-reduce reads the peers' buckets in place; training matches the single process."""
    want = train_reference("wide", world_size, 3)
    for got, symmetric in run_ranks(_symmetric_buckets, world_size, args=(as_view,), backend="shm"):
        assert_close_states(got, want)
        assert all(any(step) for step in symmetric), symmetric  # the rebuilt buckets too


def _channels_last_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 4 * 4, 5))
    return model.to(memory_format=torch.channels_last)  # the conv weight's grad is not contiguous


def _non_contiguous(rank, world_size):
    model = _channels_last_model()
    ddp = DDP(model, bucket_cap_mb=TINY_CAP_MB)  # both weights (3.4 and 10 KiB) get solo buckets
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y = torch.randn(4, 3, 6, 6, generator=g), torch.randint(0, 5, (4,), generator=g)
        opt.zero_grad()
        F.cross_entropy(ddp(x[rank * 2:(rank + 1) * 2]), y[rank * 2:(rank + 1) * 2]).backward()
        opt.step()
    in_place = {n: b.in_grad for n, p in model.named_parameters() for b in ddp.reducer.buckets
                if b.solo and b.params[0] is p}
    return state(ddp), in_place


def test_solo_bucket_falls_back_to_its_own_tensor_for_non_contiguous_grads():
    results = run_ranks(_non_contiguous, 2, backend="gloo")
    model = _channels_last_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y = torch.randn(4, 3, 6, 6, generator=g), torch.randint(0, 5, (4,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    want = state(model)
    for got, in_place in results:
        assert in_place == {"0.weight": False, "3.weight": True}, in_place
        assert_close_states(got, want)


def _channels_last_views(rank, world_size, cap_mb):
    model = _channels_last_model()
    ddp = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=cap_mb)
    x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        ddp.zero_grad()
        ddp(x[rank * 2:(rank + 1) * 2]).sum().backward()
    weight = model[0].weight
    return weight.stride(), weight.grad.stride(), weight.grad.clone()


@pytest.mark.parametrize("cap_mb", [TINY_CAP_MB, 25], ids=["solo", "coalesced"])
def test_bucket_views_keep_a_channels_last_gradient_layout(cap_mb):
    """With ``gradient_as_bucket_view`` a ``channels_last`` weight's ``.grad`` is a bucket view
    with the weight's strides, as in PyTorch (it was row-major), holding the average."""
    model = _channels_last_model()
    x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    model(x[:2]).sum().backward()
    first = model[0].weight.grad.clone()
    model.zero_grad()
    model(x[2:]).sum().backward()
    want = (first + model[0].weight.grad) / 2
    for param_strides, grad_strides, grad in run_ranks(_channels_last_views, 2, args=(cap_mb,), backend="gloo"):
        assert grad_strides == param_strides != (27, 9, 3, 1)
        torch.testing.assert_close(grad, want, **TOL)


class TwoBranch(nn.Module):
    """``net2`` is used only on rank 0; ``never`` is never used. 16x16 weights: 1 KiB, solo here."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(16, 16)
        self.net2 = nn.Linear(16, 16)
        self.never = nn.Linear(16, 16)

    def forward(self, x, use_net2=True):
        x = self.net1(x)
        return self.net2(x) if use_net2 else x


def _unused(rank, world_size):
    torch.manual_seed(0)
    ddp = DDP(TwoBranch(), find_unused_parameters=True, bucket_cap_mb=0.0005)
    assert any(b.solo for b in ddp.reducer.buckets)
    x = torch.full((2, 16), float(rank + 1))
    ddp(x, use_net2=(rank == 0)).sum().backward()
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in ddp.module.named_parameters()}


def test_solo_buckets_with_unused_parameters():
    results = run_ranks(_unused, 2, backend="gloo")
    torch.manual_seed(0)
    model = TwoBranch()
    (model(torch.full((2, 16), 1.0)).sum() + model(torch.full((2, 16), 2.0), use_net2=False).sum()).backward()
    for rank, grads in enumerate(results):
        assert grads["never.weight"] is None and grads["never.bias"] is None
        for name in ("net1.weight", "net1.bias", "net2.weight", "net2.bias"):
            want = dict(model.named_parameters())[name].grad / 2
            torch.testing.assert_close(grads[name], want, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")
