"""Small models for the tensor-parallel tests: an MLP and a transformer-like block (attention, MLP, norms)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.relu(self.w1(x)))


class Attention(nn.Module):
    """Causal multi-head attention; heads are counted from the local projection width (TP keeps whole heads)."""

    def __init__(self, dim: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[0], x.shape[1]
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, -1)
        return self.wo(out)


class Block(nn.Module):
    """Token embedding, one pre-norm transformer layer, output projection to the vocabulary."""

    def __init__(self, vocab: int = 16, dim: int = 24, head_dim: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, head_dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, 2 * dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens)
        h = h + self.attn(self.norm1(h))
        h = h + self.mlp(self.norm2(h))
        return self.out(h)
