"""Load balancing of causal attention: which sequence positions each context-parallel rank keeps.

With a causal mask, query ``i`` attends to keys ``0..i``: cutting the sequence into ``cp_size`` consecutive pieces
gives the last rank ``2 cp_size - 1`` times the work of the first. The head-tail balancer cuts it into
``2 cp_size`` chunks and gives rank ``r`` chunks ``r`` and ``2 cp_size - 1 - r``: every rank then holds one cheap
and one expensive chunk, and the same amount of work. It is expressed as an index tensor over the sequence
(``buffer.index_select(seq_dim, indices)`` puts the chunks in rank order; the argsort of it puts them back).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ._options import _cp_options


class _LoadBalancer(ABC):
    """A rearrangement of the sequence before it is sharded evenly over the context-parallel ranks."""

    @abstractmethod
    def _generate_indices(self, restore: bool = False) -> torch.Tensor | None:
        """Indices of shape ``(1, seq_len)`` (or ``(batch, seq_len)``): ``buffer[..., idx, ...]`` is the rearranged
        buffer; with ``restore=True`` the indices that undo it."""


class _HeadTailLoadBalancer(_LoadBalancer):
    """Rank ``r`` keeps chunks ``r`` and ``2 world_size - 1 - r`` of ``2 world_size`` equal chunks."""

    def __init__(self, seq_length: int, world_size: int, device: str | torch.device) -> None:
        self.seq_length = seq_length
        self.world_size = world_size
        self.device = device

    def _generate_indices(self, restore: bool = False) -> torch.Tensor:
        chunks = 2 * self.world_size
        if self.seq_length % chunks != 0:
            raise ValueError(
                f"head-tail load balancing needs a sequence length divisible by 2 x the context-parallel size "
                f"({chunks}); got {self.seq_length}"
            )
        per_chunk = self.seq_length // chunks
        order = [c for r in range(self.world_size) for c in (r, chunks - 1 - r)]
        indices = torch.arange(self.seq_length, dtype=torch.int, device=self.device).view(chunks, per_chunk)
        indices = indices[order].reshape(-1)
        if restore:
            indices = torch.argsort(indices)
        return indices.unsqueeze(0)


def _create_default_load_balancer(seq_length: int, world_size: int,
                                  device: str | torch.device) -> _LoadBalancer | None:
    """The head-tail balancer when load balancing is enabled and ``seq_length`` divides into ``2 world_size``
    chunks; otherwise None (the sequence is sharded as it is), as PyTorch decides."""
    if _cp_options.enable_load_balance and seq_length % (2 * world_size) == 0:
        return _HeadTailLoadBalancer(seq_length, world_size, device)
    return None
