"""A pipeline of two stages over RPC (PyTorch's distributed pipeline tutorial, in small).

Stage 1 lives on worker1 and stage 2 on worker2. The driver splits each batch into
micro-batches; micro-batch i goes through stage 1 (``remote``: the output stays on
worker1 as an RRef) and straight on to stage 2 (which fetches it from worker1), while
micro-batch i+1 already runs in stage 1. Training uses distributed autograd and
DistributedOptimizer.

    python examples/rpc/pipeline.py
"""

import threading

import torch

import torchdist.autograd as dist_autograd
import torchdist.rpc as rpc
from torchdist.optim import DistributedOptimizer

from _launch import spawn

MICRO_BATCHES = 4


class Stage(torch.nn.Module):
    def __init__(self, n_in, n_out, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.layer = torch.nn.Linear(n_in, n_out)
        self.lock = threading.Lock()  # micro-batches arrive on several RPC threads

    def forward(self, x_rref):
        x = x_rref.to_here()
        with self.lock:
            return torch.relu(self.layer(x))

    def parameter_rrefs(self):
        return [rpc.RRef(p) for p in self.parameters()]


class Pipeline:
    def __init__(self):
        self.stage1 = rpc.remote("worker1", Stage, args=(10, 32, 1))
        self.stage2 = rpc.remote("worker2", Stage, args=(32, 1, 2))

    def forward(self, xs):
        futures = []
        for x in xs.chunk(MICRO_BATCHES):
            y_rref = self.stage1.remote().forward(rpc.RRef(x))  # stays on worker1
            futures.append(self.stage2.rpc_async().forward(y_rref))
        return torch.cat(torch.futures.wait_all(futures))

    def parameter_rrefs(self):
        return self.stage1.rpc_sync().parameter_rrefs() + self.stage2.rpc_sync().parameter_rrefs()


def run(rank, world_size):
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    if rank == 0:
        torch.manual_seed(0)
        x = torch.randn(64, 10)
        y = (x[:, :3].sum(dim=1, keepdim=True)).relu()
        pipe = Pipeline()
        optimizer = DistributedOptimizer(torch.optim.Adam, pipe.parameter_rrefs(), lr=0.01)
        losses = []
        for _ in range(40):
            with dist_autograd.context() as context_id:
                loss = torch.nn.functional.mse_loss(pipe.forward(x), y)
                dist_autograd.backward(context_id, [loss])
                optimizer.step(context_id)
            losses.append(loss.item())
        print(f"pipeline: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
        assert losses[-1] < losses[0] / 3, "training did not converge"
        print("pipeline: OK")
    rpc.shutdown()


if __name__ == "__main__":
    spawn(run, 3)
