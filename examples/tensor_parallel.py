"""Tensor-parallel training with torchdist: a small language-model block split Megatron-style over the ranks.

The embedding is split by rows, the attention's query/key/value projections and the first MLP layer by output
features (ColwiseParallel), their output projections by input features (RowwiseParallel), and the vocabulary
projection by columns, whose class-sharded logits go straight into ``loss_parallel``'s cross-entropy. Every
rank sees the same tokens; rank 0 prints the loss, and at the end every rank checks that it matches a copy of
the model trained without parallelism.

    torchdist-run --standalone --nproc-per-node 2 examples/tensor_parallel.py
"""

from __future__ import annotations

import argparse
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchdist as dist
from torchdist.device_mesh import init_device_mesh
from torchdist.tensor import Replicate
from torchdist.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

VOCAB, DIM, HEAD_DIM, SEQ = 32, 32, 4, 16


class Attention(nn.Module):
    """Causal self-attention; the head count comes from the local projection width, so TP keeps whole heads."""

    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[:2]
        q, k, v = (w(x).view(b, s, -1, HEAD_DIM).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        scores = (q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM)).masked_fill(
            ~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
        return self.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.attn = Attention()
        self.w1, self.w2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens)
        h = h + self.attn(self.norm(h))
        h = h + self.w2(F.gelu(self.w1(h)))
        return self.out(h)


PLAN = {
    "tok": RowwiseParallel(input_layouts=Replicate()),
    "attn.w[qkv]": ColwiseParallel(),
    "attn.wo": RowwiseParallel(),
    "w1": ColwiseParallel(),
    "w2": RowwiseParallel(),
    "out": ColwiseParallel(use_local_output=False),  # logits stay a DTensor sharded on the vocabulary
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = TinyLM()
    reference = copy.deepcopy(model)
    parallelize_module(model, mesh, PLAN)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    # A learnable sequence: each token is the previous one plus 3, modulo the vocabulary.
    data = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        start = torch.randint(0, VOCAB, (8, 1), generator=data)
        seq = (start + 3 * torch.arange(SEQ + 1)) % VOCAB
        tokens, labels = seq[:, :-1], seq[:, 1:]
        with loss_parallel():
            loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = F.cross_entropy(reference(tokens).flatten(0, 1), labels.flatten())
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if rank == 0:
            print(f"step {step:3d} loss {loss.full_tensor().item():.4f}", flush=True)
    # Parameters the plan does not name (the LayerNorm's) stay plain tensors, replicated by construction.
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    same = all(torch.allclose(p, q, atol=1e-4) for p, q in zip(whole, reference.parameters()))
    print(f"rank {rank}: matches the unparallelized model: {same}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
