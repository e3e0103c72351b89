"""The quantization hooks against PyTorch's: its arithmetic in one process, and its hook in DDP on gloo.

PyTorch 2.13's own hooks raise IndexError on gloo: they read the all-gather future's value as
``[ranks' tensors stacked]`` (the per-channel hook indexes it ``[rank, 0, :]``), gloo gives
``[tensor of each rank]``. The DDP comparison gives them the value they expect, which changes
nothing else.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from torchdist.algorithms import ddp_comm_hooks
from torchdist.algorithms.ddp_comm_hooks import (
    DDPCommHookType,
    quantization_hooks,
    quantization_perchannel_hook,
    quantization_pertensor_hook,
    register_ddp_comm_hook,
)
from torchdist.nn.parallel import DistributedDataParallel as DDP
from torchdist._ddp.bucket import GradBucket
from torchdist.testing import free_port, run_ranks

from ._common import LR, build, full_batches, shard, state

# (name, numel, dtype, per-channel bucket_size): a partial last channel, whole channels (PyTorch
# pads one more), one short channel, all-positive values, and float64 / float16 buckets
CASES = [("mixed", 1573, torch.float32, 512), ("whole-channels", 1024, torch.float32, 512),
         ("tiny", 7, torch.float32, 512), ("positive", 300, torch.float32, 64), ("float64", 1000, torch.float64, 128),
         ("float16", 700, torch.float16, 100)]


def _buffer(name: str, rank: int) -> torch.Tensor:
    """Rank ``rank``'s bucket for case ``name``: the same in the ranks and in the test."""
    _, numel, dtype, _ = next(c for c in CASES if c[0] == name)
    g = torch.Generator().manual_seed(1000 * CASES.index(next(c for c in CASES if c[0] == name)) + rank)
    x = torch.randn(numel, generator=g) * (rank + 1) * 1e-2
    if name == "positive":
        x = x.abs() + 0.5
    return x.to(dtype)


def _torch_reference(buffers: list[torch.Tensor], per_channel: bool, bucket_size: int) -> torch.Tensor:
    """PyTorch's hook, every rank in one process: its observers and its (de)quantization helpers."""
    from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as torch_q

    numel = buffers[0].numel()
    total = None
    for x in buffers:
        if per_channel:
            x = F.pad(x, (0, bucket_size - numel % bucket_size)).view(-1, bucket_size)
            observer = torch.ao.quantization.PerChannelMinMaxObserver()
            observer(x)
            params = torch.stack(observer.calculate_qparams())
            q = torch_q._quantize_per_channel_backend(x, params[0], params[1])
            y = torch_q._dequantize_per_channel_backend(q, params[0], params[1])
        else:
            observer = torch.ao.quantization.MinMaxObserver()
            observer(x)
            s, z = observer.calculate_qparams()
            params = torch.FloatTensor([s, z])
            y = torch_q._dequantize_per_tensor_backend(torch_q._quantize_per_tensor_backend(x, params[0], params[1]),
                                                       params[0], params[1])
        total = y if total is None else total + y
    return total.flatten()[:numel] / len(buffers)


def _hook_values(rank, world_size):
    results = {}
    for name, _, _, bucket_size in CASES:
        for per_channel in (False, True):
            buffer = _buffer(name, rank)
            before = buffer.clone()
            bucket = GradBucket(0, buffer, [], [], True)
            if per_channel:
                fut = quantization_perchannel_hook(None, bucket, bucket_size=bucket_size)
            else:
                fut = quantization_pertensor_hook(None, bucket)
            results[name, per_channel] = (fut.wait(), torch.equal(buffer, before))
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_hooks_give_pytorchs_numbers(world_size):
    ranks = run_ranks(_hook_values, world_size, backend="gloo")
    for name, numel, _, bucket_size in CASES:
        buffers = [_buffer(name, r) for r in range(world_size)]
        for per_channel in (False, True):
            want = _torch_reference(buffers, per_channel, bucket_size)
            assert want.dtype == torch.float32 and want.numel() == numel
            for rank, results in enumerate(ranks):
                got, untouched = results[name, per_channel]
                assert untouched, f"{name}: the hook changed the bucket"
                assert got.dtype == torch.float32 and got.shape == (numel,), (got.dtype, got.shape)
                assert torch.equal(got, want), f"{name}, per_channel={per_channel}, rank {rank}"
            # and 8 bits keep the average to within about a step of the widest rank's scale
            exact = torch.stack([b.to(torch.float64) for b in buffers]).mean(0)
            widest = max(float(b.to(torch.float32).max().clamp(min=0) - b.to(torch.float32).min().clamp(max=0))
                         for b in buffers)
            assert float((want.to(torch.float64) - exact).abs().max()) <= widest / 255


class _NestedAllGather:
    """``torch.distributed`` as PyTorch's quantization hooks expect it: an all-gather future whose
    value is ``[ranks' tensors stacked]`` (gloo in 2.13 gives ``[tensor of each rank]``)."""

    def __init__(self, dist) -> None:
        self._dist = dist

    def __getattr__(self, name):
        return getattr(self._dist, name)

    def all_gather(self, *args, **kwargs):
        work = self._dist.all_gather(*args, **kwargs)

        class Nested:
            @staticmethod
            def get_future():
                return work.get_future().then(lambda fut: [torch.stack(fut.value())])
        return Nested()


def _train_like_torch(rank, world_size, steps):
    """The same training with torch's DDP and quantization hooks, then with torchdist's."""
    import torch.distributed as torch_dist
    from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as torch_q
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import torchdist

    port = [free_port() if rank == 0 else None]
    torchdist.broadcast_object_list(port)
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port[0]}", rank=rank,
                                  world_size=world_size)
    torch_q.dist = _NestedAllGather(torch_dist)
    results = {}
    for hook_name in ("quantization_pertensor_hook", "quantization_perchannel_hook"):
        for name, ddp_class, hooks in (("torch", TorchDDP, torch_q), ("torchdist", DDP, quantization_hooks)):
            ddp = ddp_class(build("mlp"))  # one bucket in both: PyTorch's hooks race a second one
            opt = torch.optim.SGD(ddp.parameters(), lr=LR)
            batches = full_batches("mlp", world_size, steps + 1)
            # PyTorch's first bucket holds the parameters in model order, its rebuilt one (as torchdist's
            # from the start) in gradient order, and per channel they quantize differently: a first
            # backward, without a hook or a step (plain all-reduces round differently), rebuilds it
            F.cross_entropy(ddp(shard(batches[0][0], rank)), shard(batches[0][1], rank)).backward()
            ddp.register_comm_hook(None, getattr(hooks, hook_name))
            for x, y in batches[1:]:
                opt.zero_grad()
                F.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()
                opt.step()
            results[hook_name, name] = state(ddp)
    torch_dist.destroy_process_group()
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_training_matches_pytorchs_hooks_on_gloo(world_size):
    for results in run_ranks(_train_like_torch, world_size, args=(3,), backend="gloo",
                             env={"GLOO_SOCKET_IFNAME": "lo"}, timeout=120):
        for hook_name in ("quantization_pertensor_hook", "quantization_perchannel_hook"):
            got, want = results[hook_name, "torchdist"], results[hook_name, "torch"]
            for k in want:
                assert torch.equal(got[k], want[k]), f"{hook_name}: {k} differs from PyTorch's"


def test_hook_types_are_pytorchs_in_pytorchs_order():
    from torch.distributed.algorithms.ddp_comm_hooks import DDPCommHookType as TorchDDPCommHookType

    assert [t.name for t in DDPCommHookType] == [t.name for t in TorchDDPCommHookType]

    class Model:
        def register_comm_hook(self, state_, hook):
            self.registered = (state_, hook)

    model = Model()
    register_ddp_comm_hook(DDPCommHookType.QUANTIZE_PER_TENSOR, model, "group")
    assert model.registered == ("group", quantization_pertensor_hook)
    DDPCommHookType.QUANTIZE_PER_CHANNEL.value(model=model, state=None)
    assert model.registered == (None, quantization_perchannel_hook)
    assert ddp_comm_hooks.quantization is quantization_hooks


def test_perchannel_bucket_size_must_be_positive():
    bucket = GradBucket(0, torch.zeros(4), [], [], True)
    with pytest.raises(ValueError, match="bucket_size must be at least 1, got 0"):
        quantization_perchannel_hook(None, bucket, bucket_size=0)
    with pytest.raises(ValueError, match="got -3"):
        functools.partial(quantization_perchannel_hook, bucket_size=-3)(None, bucket)
