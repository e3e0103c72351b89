"""Pipeline-parallel training with torchdist: a small MLP cut into one stage per rank.

Each rank builds its stage (a slice of the layers), and ``Schedule1F1B``
splits every batch into microbatches, sends activations forward and gradients
back between neighbouring ranks, and leaves each rank with the gradients of
its own layers; each rank then steps its own optimizer. The rank holding the
last stage prints the loss.

    torchdist-run --standalone --nproc-per-node 2 examples/pipeline_parallel.py
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchdist as dist
from torchdist.pipelining import PipelineStage, Schedule1F1B

WIDTH = 16


def stage_module(stage: int, num_stages: int) -> nn.Module:
    """Stage ``stage`` of a ``2 * num_stages``-layer MLP (the same weights on every run)."""
    torch.manual_seed(stage)
    layers: list[nn.Module] = []
    for i in range(2):
        layers.append(nn.Linear(WIDTH, WIDTH))
        if not (stage == num_stages - 1 and i == 1):
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    stage = PipelineStage(stage_module(rank, world), rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, max(args.microbatches, world), loss_fn=F.mse_loss)
    optimizer = torch.optim.SGD(stage.submod.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, WIDTH, generator=g)
    y = torch.sin(x)  # something to learn
    for step in range(args.steps):
        optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        if rank == 0 and world == 1:
            schedule.step(x, target=y, losses=losses)
        elif rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        optimizer.step()
        if losses:
            print(f"step {step:3d}  loss {torch.stack(losses).mean().item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
