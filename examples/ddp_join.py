"""Uneven inputs: ranks with fewer batches than others, under ``ddp.join()``.

Rank r gets ``10 + 5 r`` batches. Without ``join()`` the rank that finishes first
would stop taking part in the gradient all-reduces and the others would hang.
Inside ``join()`` it shadows their collectives until every rank is done, and at
the end all replicas hold the same parameters.

    torchdist-run --nproc-per-node 3 examples/ddp_join.py
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchdist as dist
from torchdist.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    n_batches = 10 + 5 * rank
    with model.join():
        for _ in range(n_batches):
            x = torch.randn(16, 8, generator=g)
            optimizer.zero_grad()
            F.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
            optimizer.step()
    print(f"rank {rank}: trained on {n_batches} batches, then joined")
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.zeros_like(weights) for _ in range(world_size)]
    dist.all_gather(everyone, weights)
    if rank == 0:
        print(f"replicas identical after join: {all(torch.equal(w, weights) for w in everyone)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
