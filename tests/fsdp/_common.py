"""Models, data and training loops shared by the FSDP tests: one program for torch's FSDP2, torchdist's, and a
single process.

Every rank holds the same initial model (same seed) and trains on its chunk of
each global batch; the loss is a mean over the local batch, so FSDP's averaged
gradients equal the single-process gradients of the whole batch.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

STEPS = 2
LOCAL_BATCH = 2
LR = 0.05


class MLP(nn.Module):
    """Layers with odd sizes, so that shards are uneven at world sizes 2-4 (some ranks get no rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(5, 7), nn.Linear(7, 3), nn.Linear(3, 2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x

    def tail(self, x: torch.Tensor) -> torch.Tensor:
        """Another entry point (for ``register_fsdp_forward_method``): the last layer only."""
        return self.layers[-1](x)


class Block(nn.Module):
    """A pre-norm transformer block: single-head causal attention and an MLP."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # no qkv bias: the key bias has a zero gradient (softmax ignores it), and AdamW would amplify its noise
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 2 * dim + 1), nn.Linear(2 * dim + 1, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 11, dim: int = 6, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return MLP() if kind == "mlp" else TinyTransformer()


def batches(kind: str, world_size: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of ``LOCAL_BATCH * world_size`` samples: (inputs, targets)."""
    g = torch.Generator().manual_seed(1)
    n = LOCAL_BATCH * world_size
    if kind == "mlp":
        return [(torch.randn(n, 5, generator=g), torch.randn(n, 2, generator=g)) for _ in range(steps)]
    return [(torch.randint(0, 11, (n, 5), generator=g), torch.randint(0, 11, (n, 5), generator=g))
            for _ in range(steps)]


def loss_of(kind: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    out = out.float()
    if kind == "mlp":
        return F.mse_loss(out, target)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def optimizer(name: str, params, lr: float = LR) -> torch.optim.Optimizer:
    """AdamW (the usual FSDP optimizer; single-tensor or foreach) or SGD (its updates scale with the gradients: for
    tolerance checks)."""
    if name.startswith("adamw"):
        return torch.optim.AdamW(params, lr=lr, foreach=name == "adamw_foreach")
    return torch.optim.SGD(params, lr=lr)


def train_reference(kind: str, world_size: int, accumulate: int = 1, optim: str = "adamw", lr_scale: float = 1.0,
                    clip: float | None = None) -> dict[str, torch.Tensor]:
    """Single-process training on the whole global batches; with ``accumulate``, each global batch is cut into
    that many micro-batches whose gradients add up (each scaled as FSDP scales them)."""
    model = make_model(kind)
    opt = optimizer(optim, model.parameters(), LR * lr_scale)
    for x, y in batches(kind, world_size):
        for xs, ys in zip(x.chunk(world_size), y.chunk(world_size)):  # rank by rank: the same arithmetic as FSDP
            for xm, ym in zip(xs.chunk(accumulate), ys.chunk(accumulate)):
                (loss_of(kind, model(xm), ym) / world_size).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return {name: p.detach().float().clone() for name, p in model.named_parameters()}


def libs(lib: str):
    """(c10d module, fsdp module, init_device_mesh) of ``lib``; torch's default group (gloo) is made here."""
    if lib == "torch":
        import torch.distributed as tdist

        tdist.init_process_group("gloo")
        return (tdist, importlib.import_module("torch.distributed.fsdp"),
                importlib.import_module("torch.distributed.device_mesh").init_device_mesh)
    import torchdist

    return (torchdist, importlib.import_module("torchdist.fsdp"),
            importlib.import_module("torchdist.device_mesh").init_device_mesh)


class OncePerWorldSize:
    """``run_both(rank, world_size) -> (torch's observations, torchdist's)`` spawned once per world size for a
    whole test module; calls give (world size, torch's per-rank observations, torchdist's)."""

    def __init__(self, run_both: Callable) -> None:
        self._run_both = run_both
        self._results: dict[int, tuple[int, list, list]] = {}

    def __call__(self, world_size: int) -> tuple[int, list, list]:
        if world_size not in self._results:
            from torchdist.testing import run_ranks

            results = run_ranks(self._run_both, world_size, timeout=100)
            self._results[world_size] = (world_size, [w for w, _ in results], [g for _, g in results])
        return self._results[world_size]
