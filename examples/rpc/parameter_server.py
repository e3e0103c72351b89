"""A parameter server with several trainers (PyTorch's RPC parameter-server tutorial, in small).

Worker "ps" owns the model. Each trainer, concurrently and without locks between them
(Hogwild-style), runs the forward on the server through an RRef, a distributed backward,
and a DistributedOptimizer step that updates the parameters on the server.

    python examples/rpc/parameter_server.py
"""

import threading

import torch

import torchdist.autograd as dist_autograd
import torchdist.rpc as rpc
from torchdist.optim import DistributedOptimizer

from _launch import spawn

NUM_TRAINERS = 2
STEPS = 30


class ParameterServer:
    def __init__(self):
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 1)
        self.lock = threading.Lock()

    def forward(self, x):
        return self.model(x)

    def parameter_rrefs(self):
        return [rpc.RRef(p) for p in self.model.parameters()]


def train(ps_rref, rank):
    torch.manual_seed(rank)
    true_w = torch.tensor([[1.0, -2.0, 3.0, 0.5]])
    optimizer = DistributedOptimizer(torch.optim.SGD, ps_rref.rpc_sync().parameter_rrefs(), lr=0.05)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(16, 4)
        y = x @ true_w.t()
        with dist_autograd.context() as context_id:
            loss = torch.nn.functional.mse_loss(ps_rref.rpc_sync().forward(x), y)
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)
        losses.append(loss.item())
    return losses[0], losses[-1]


def run(rank, world_size):
    name = "ps" if rank == 0 else f"trainer{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world_size)
    if rank == 0:
        ps_rref = rpc.RRef(ParameterServer())
        futures = [rpc.rpc_async(f"trainer{r}", train, args=(ps_rref, r)) for r in range(1, world_size)]
        for r, (first, last) in enumerate(torch.futures.wait_all(futures), start=1):
            print(f"trainer{r}: loss {first:.3f} -> {last:.3f}")
            assert last < first / 4, "training did not converge"
        print("parameter server: OK")
    rpc.shutdown()


if __name__ == "__main__":
    spawn(run, NUM_TRAINERS + 1)
