"""Gradient accumulation with ``DistributedDataParallel.no_sync()``.

Each optimizer step here sees ``--accumulate`` micro-batches per rank. The
backward passes of all but the last run inside ``no_sync()``: gradients only
accumulate locally, with no communication; the last backward all-reduces the
accumulated sum once. The result equals one big batch, at one all-reduce per step.

    torchdist-run --nproc-per-node 2 examples/ddp_no_sync.py --accumulate 4
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchdist as dist
from torchdist.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accumulate", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    true_w = torch.randn(16, 1)
    model = DDP(nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    for step in range(args.steps):
        optimizer.zero_grad()
        for micro in range(args.accumulate):
            x = torch.randn(8, 16, generator=g)
            last = micro == args.accumulate - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = F.mse_loss(model(x), x @ true_w) / args.accumulate
                loss.backward()  # communicates only when `last`
        optimizer.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item() * args.accumulate:.5f}")
    error = (model.module.weight.detach().T - true_w).abs().max().item()
    if rank == 0:
        print(f"max |w - w_true| = {error:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
