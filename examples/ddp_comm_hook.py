"""DDP communication hooks: compress the gradients DDP all-reduces.

``--hook fp16`` all-reduces a float16 copy of each bucket (half the bytes);
``--hook powersgd`` sends a rank-2 approximation of each gradient matrix
(PowerSGD, Vogels et al. 2019), after 10 plain iterations. The script prints the
loss curve and, for PowerSGD, how much smaller the traffic was.

    torchdist-run --nproc-per-node 2 examples/ddp_comm_hook.py --hook powersgd
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchdist as dist
from torchdist.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torchdist.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hook", choices=["allreduce", "fp16", "bf16", "powersgd"], default="powersgd")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    model = DDP(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8)))
    state = None
    if args.hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=10)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        hook = {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
                "bf16": default_hooks.bf16_compress_hook}[args.hook]
        model.register_comm_hook(None, hook)  # state: the process group (None: the default one)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        x = torch.randn(32, 32, generator=g)
        with torch.no_grad():
            target = teacher(x)
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 10 == 0:
            print(f"[{args.hook}] step {step:3d}  loss {loss.item():.5f}")
    if rank == 0 and state is not None:
        rate, before, after = state.compression_stats()
        print(f"PowerSGD: {before} gradient elements compressed to {after} (rate {rate:.1f}x)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
