"""Models, data and the single-process reference shared by the FSDP1 tests.

Every rank holds the same initial model (same seed) and trains on its chunk of
each global batch; the loss is a mean over the local batch, so FSDP's averaged
gradients equal the single-process gradients of the whole batch.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fsdp._common import LR, TinyTransformer, batches, loss_of  # the FSDP2 tests' data, loss and transformer


class MLP(nn.Module):
    """Odd layer sizes, so that flat shards are uneven at world sizes 2-4."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3), nn.ReLU(), nn.Linear(3, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return MLP() if kind == "mlp" else TinyTransformer()


def train_reference(kind: str, world_size: int, accumulate: int = 1, clip: float | None = None,
                    with_optim: bool = False):
    """Single-process training on the whole global batches, rank chunk by rank chunk (FSDP's arithmetic).

    Returns the parameters by name; with ``with_optim`` also the optimizer state by parameter name (what
    ``FSDP.optim_state_dict`` must give).
    """
    model = make_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for x, y in batches(kind, world_size):
        for xs, ys in zip(x.chunk(world_size), y.chunk(world_size)):
            for xm, ym in zip(xs.chunk(accumulate), ys.chunk(accumulate)):
                (loss_of(kind, model(xm), ym) / (world_size * accumulate)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    if not with_optim:
        return params
    return params, {name: {k: v.clone() for k, v in opt.state[p].items()} for name, p in model.named_parameters()}
