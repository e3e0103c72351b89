"""A model split across two workers, trained with distributed autograd and DistributedOptimizer.

The driver (worker0) holds the data; worker1 owns the first half of the model, worker2
the second. The forward is two RPCs; ``dist_autograd.backward`` runs the backward pass
across all three workers, and ``DistributedOptimizer`` updates each half where it lives.

    python examples/rpc/model_parallel.py
"""

import torch

import torchdist.autograd as dist_autograd
import torchdist.rpc as rpc
from torchdist.optim import DistributedOptimizer

from _launch import spawn


class Half(torch.nn.Module):
    def __init__(self, n_in, n_out, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(n_in, n_out), torch.nn.Tanh())

    def forward(self, x):
        return self.net(x)

    def parameter_rrefs(self):
        return [rpc.RRef(p) for p in self.parameters()]


class SplitModel:
    """The driver's view: two remote halves."""

    def __init__(self):
        self.first = rpc.remote("worker1", Half, args=(8, 16, 1))
        self.second = rpc.remote("worker2", Half, args=(16, 1, 2))

    def forward(self, x):
        return self.second.rpc_sync().forward(self.first.rpc_sync().forward(x))

    def parameter_rrefs(self):
        return self.first.rpc_sync().parameter_rrefs() + self.second.rpc_sync().parameter_rrefs()


def run(rank, world_size):
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    if rank == 0:
        torch.manual_seed(0)
        x = torch.randn(64, 8)
        y = torch.tanh(x[:, :1] - x[:, 1:2])
        model = SplitModel()
        optimizer = DistributedOptimizer(torch.optim.Adam, model.parameter_rrefs(), lr=0.02)
        losses = []
        for _ in range(60):
            with dist_autograd.context() as context_id:
                loss = torch.nn.functional.mse_loss(model.forward(x), y)
                dist_autograd.backward(context_id, [loss])
                optimizer.step(context_id)
            losses.append(loss.item())
        print(f"model parallel: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
        assert losses[-1] < losses[0] / 3, "training did not converge"
        print("model parallel: OK")
    rpc.shutdown()


if __name__ == "__main__":
    spawn(run, 3)
