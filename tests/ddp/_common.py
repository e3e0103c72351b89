"""Models, data and reference training shared by the DDP tests.

Every DDP result is compared with a single process that trains the same model on
the concatenation of the ranks' batches: rank r's batch is rows
``[r*per_rank, (r+1)*per_rank)`` of the full batch. Tolerance: rtol 1.3e-6,
atol 5e-5 (PyTorch's DDP tests, inventory statement 67).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

TOL = {"rtol": 1.3e-6, "atol": 5e-5}
PER_RANK = 4
LR = 0.1


class Mlp(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, width)
        self.net2 = nn.Linear(width, width)
        self.out = nn.Linear(width, 5)

    def forward(self, x):
        return self.out(F.relu(self.net2(F.relu(self.net1(x)))))


class Cnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 2 * 2, 5)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


# "wide": 256 KiB weights, under the solo size, sharing a coalesced bucket of ~300 KiB
MODELS = {"mlp": (Mlp, (10,)), "cnn": (Cnn, (3, 8, 8)), "wide": (functools.partial(Mlp, 256), (10,))}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name][0]()


def full_batches(name: str, world_size: int, steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = MODELS[name][1]
    n = world_size * PER_RANK
    return [(torch.randn(n, *shape, generator=g), torch.randint(0, 5, (n,), generator=g)) for _ in range(steps)]


def shard(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[rank * PER_RANK:(rank + 1) * PER_RANK]


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def train_reference(name: str, world_size: int, steps: int, opt_class=torch.optim.SGD, **opt_kwargs):
    """The single-process run every DDP run is compared with."""
    model = build(name)
    opt = opt_class(model.parameters(), **(opt_kwargs or {"lr": LR}))
    for x, y in full_batches(name, world_size, steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return state(model)


def assert_close_states(got: dict, want: dict, prefix: str = "module.", **tol) -> None:
    tol = tol or TOL
    for k, v in want.items():
        torch.testing.assert_close(got[prefix + k], v, **tol, msg=lambda m: f"{k}: {m}")
