"""DDP under distributed autograd: gradients averaged in the backward's context, as PyTorch's DDP does.

The pattern of PyTorch's "Combining DDP with Distributed RPC" example: a DDP model
whose backward runs through ``torchdist.autograd.backward``. The gradients then live
in the context (``.grad`` stays None), and DDP must average them there.
"""

from __future__ import annotations

import pytest
import torch

import torchdist as dist
import torchdist.autograd as dist_autograd
import torchdist.rpc as rpc
from torchdist.optim import DistributedOptimizer
from torchdist.testing import free_port, run_ranks

from ._common import TOL

STEPS = 3
LR = 0.1


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(3, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(rank: int, world_size: int, as_view: bool, port: int):
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}"))
    model = dist.DistributedDataParallel(_model(), gradient_as_bucket_view=as_view, bucket_cap_mb=0.0001)
    optimizer = DistributedOptimizer(torch.optim.SGD, [rpc.RRef(p) for p in model.parameters()], lr=LR)
    first_grads = None
    for step in range(STEPS):
        with dist_autograd.context() as context_id:
            loss = model(_batch(rank, step)).square().sum()
            dist_autograd.backward(context_id, [loss])
            grads = dist_autograd.get_gradients(context_id)
            if first_grads is None:
                first_grads = [grads[p].clone() for p in model.parameters()]
            optimizer.step(context_id)
    untouched = all(p.grad is None for p in model.parameters())
    rpc.shutdown()
    return first_grads, [p.detach().clone() for p in model.parameters()], untouched


def _reference(world_size: int):
    """One process: SGD on the average of every rank's gradient (what DDP computes)."""
    model = _model()
    first_grads = None
    for step in range(STEPS):
        model.zero_grad()
        for rank in range(world_size):
            (model(_batch(rank, step)).square().sum() / world_size).backward()
        if first_grads is None:
            first_grads = [p.grad.clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return first_grads, [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("world_size, as_view", [(2, False), (3, True)])
def test_ddp_averages_the_gradients_of_a_distributed_backward(world_size: int, as_view: bool) -> None:
    want_grads, want_params = _reference(world_size)
    for grads, params, untouched in run_ranks(_train, world_size, args=(as_view, free_port()), backend="tcp",
                                               timeout=90):
        assert untouched, ".grad must stay None: a distributed backward keeps gradients in its context"
        for got, want in zip(grads, want_grads):
            torch.testing.assert_close(got, want, **TOL)
        for got, want in zip(params, want_params):
            torch.testing.assert_close(got, want, **TOL)
