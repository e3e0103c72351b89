"""Data-parallel training with torchdist: each rank trains on its shard and averages gradients.

This is what DistributedDataParallel automates: every rank holds a replica of the
model, computes gradients on its own slice of the batch, and ``all_reduce``s them
(AVG) before the optimizer step, so all replicas stay identical. The script starts
its own worker processes (like the seed tutorial's ``init_process``), trains an
MLP on a synthetic two-spirals data set, and checks at the end that every rank
holds bit-identical parameters.

    python examples/data_parallel_sgd.py --nproc 2 --epochs 30
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import socket

import torch
import torch.nn as nn

import torchdist as dist


def two_spirals(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A classic non-linear 2-class problem, generated deterministically."""
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(n, generator=g) * 3 * math.pi
    label = torch.randint(0, 2, (n,), generator=g)
    sign = 1 - 2 * label.float()
    x = torch.stack([sign * t * torch.cos(t), sign * t * torch.sin(t)], dim=1) / (3 * math.pi)
    x += 0.02 * torch.randn(n, 2, generator=g)
    return x, label


def train(rank: int, world_size: int, epochs: int, batch: int) -> None:
    dist.init_process_group("tcp", rank=rank, world_size=world_size)
    torch.manual_seed(1234 + rank)  # different seeds on purpose: the broadcast below aligns them
    model = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = two_spirals(4096)
    x_test, y_test = two_spirals(1024, seed=1)
    for epoch in range(epochs):
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        total = torch.zeros(2)
        for start in range(0, len(x), batch * world_size):
            idx = perm[start + rank * batch : start + (rank + 1) * batch]  # this rank's shard
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            optimizer.zero_grad()
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
            optimizer.step()
            total += torch.tensor([loss.item() * len(idx), len(idx)])
        dist.all_reduce(total)
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        if rank == 0 and (epoch % 5 == 4 or epoch == epochs - 1):
            print(f"epoch {epoch + 1:3d}  loss {total[0] / total[1]:.4f}  test accuracy {accuracy:.3f}", flush=True)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    replicas = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(replicas, flat)
    identical = all(torch.equal(replicas[0], r) for r in replicas)
    if rank == 0:
        print(f"final test accuracy {accuracy:.3f}; parameters identical on all {world_size} ranks: {identical}")
    dist.destroy_process_group()
    if not identical:
        raise SystemExit("replicas diverged")


def _worker(rank: int, world_size: int, port: int, epochs: int, batch: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # one core per rank: more threads only fight over the cores
    train(rank, world_size, epochs, batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    args = parser.parse_args()
    with socket.socket() as s:  # a free port for the rendezvous store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, args.nproc, port, args.epochs, args.batch))
             for r in range(args.nproc)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise SystemExit(f"ranks {failed} failed")


if __name__ == "__main__":
    main()
