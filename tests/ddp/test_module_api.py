"""The DDP module as users handle it, compared with PyTorch 2.13's: copies and pickles,
forwards without grad, outputs in dataclasses, zero bucket caps, builtin hooks."""

import copy
import dataclasses
import io
import pickle

import pytest
import torch
import torch.nn as nn

import torchdist as dist
from torchdist.testing import run_ranks


def _copies(rank, world):
    ddp = dist.DistributedDataParallel(nn.Linear(3, 3))
    ddp(torch.ones(2, 3)).sum().backward()
    buffer = io.BytesIO()
    torch.save(ddp, buffer)
    buffer.seek(0)
    copies = [copy.deepcopy(ddp), pickle.loads(pickle.dumps(ddp)), torch.load(buffer, weights_only=False)]
    grads = []
    for twin in copies:  # each copy has a reducer of its own, on the default group
        twin.zero_grad()
        twin(torch.full((2, 3), float(rank))).sum().backward()
        grads.append(twin.module.weight.grad.tolist())
    return grads


def test_deepcopy_pickle_and_torch_save_give_working_replicas():
    for grads in run_ranks(_copies, 2, backend="gloo", timeout=60):
        assert grads == [[[1.0] * 3] * 3] * 3  # the average of 0 and 2


def _buffers_after_a_no_grad_forward(rank, world):
    ddp = dist.DistributedDataParallel(nn.BatchNorm1d(2))
    ddp(torch.randn(4, 2)).sum().backward()
    before = ddp.will_sync_module_buffers()
    with torch.no_grad():
        ddp(torch.randn(4, 2))
    return before, ddp.will_sync_module_buffers()


def test_a_forward_without_grad_turns_off_the_next_buffer_sync():
    assert run_ranks(_buffers_after_a_no_grad_forward, 2, backend="gloo", timeout=60) == [(True, False)] * 2


@dataclasses.dataclass
class _Output:
    value: torch.Tensor


class _DataclassModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(3, 1), nn.Linear(3, 1)

    def forward(self, x):
        return {"out": _Output(self.used(x))}


def _dataclass_output(rank, world, kwargs):
    torch.manual_seed(0)
    ddp = dist.DistributedDataParallel(_DataclassModule(), **kwargs)
    for _ in range(2):
        ddp.zero_grad()
        ddp(torch.full((2, 3), float(rank + 1)))["out"].value.sum().backward()
    return ddp.module.used.weight.grad.tolist(), ddp.module.unused.weight.grad


@pytest.mark.parametrize("kwargs", [{"find_unused_parameters": True}, {"find_unused_parameters": True, "bucket_cap_mb": 0}],
                         ids=["find-unused", "zero-bucket-cap"])
def test_outputs_inside_dataclasses_and_a_zero_bucket_cap_train_as_in_pytorch(kwargs):
    for used, unused in run_ranks(_dataclass_output, 2, args=(kwargs,), backend="gloo", timeout=60):
        assert used == [[3.0] * 3] and unused is None  # the average of 2 and 4 (two rows of 1s, then 2s)


def _builtin_hook(rank, world):
    ddp = dist.DistributedDataParallel(nn.Linear(4, 1, bias=False))
    try:
        ddp._register_builtin_comm_hook(dist.algorithms.ddp_comm_hooks.DDPCommHookType.ALLREDUCE)
    except TypeError:
        wrong_type = "TypeError"
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    ddp(torch.full((1, 4), float(rank + 1))).sum().backward()
    return wrong_type, ddp.module.weight.grad.tolist()


def test_builtin_comm_hooks_by_builtin_type():
    for wrong_type, grad in run_ranks(_builtin_hook, 2, backend="gloo", timeout=60):
        assert wrong_type == "TypeError" and grad == [[1.5] * 4]


def _construction_fails(rank, world):
    import gc
    import sys

    unraisable = []
    sys.unraisablehook = unraisable.append

    def no_memory(nbytes):
        raise dist.DistNetworkError("cannot allocate shared memory: [Errno 24] Too many open files")

    dist.group.WORLD.backend.allocate_symmetric = no_memory
    with pytest.raises(dist.DistNetworkError):
        dist.DistributedDataParallel(nn.Linear(256, 256))  # a 257 KB bucket: symmetric memory
    gc.collect()
    return [str(u.exc_value) for u in unraisable]


def test_a_ddp_whose_buckets_cannot_be_made_raises_without_noise_from_its_reducer():
    for unraisable in run_ranks(_construction_fails, 2, backend="shm", timeout=60):
        assert unraisable == []
