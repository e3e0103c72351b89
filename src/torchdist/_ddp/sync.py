"""Keeping replicas identical: shape checks and coalesced broadcasts of module state.

DDP's correctness rests on every rank starting from the same parameters and
buffers (Li et al., VLDB 2020, section 3.2.1): the constructor checks that all
ranks hold the same parameter shapes, then broadcasts rank 0's parameters and
buffers. Tensors are broadcast *coalesced*: flattened into one tensor per dtype
(at most ``buffer_size`` bytes each), so a model with hundreds of small tensors
costs a handful of collectives, not hundreds.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .._algorithms.comm import flatten, unflatten_into
from .._c10d.collectives import all_reduce, broadcast
from .._c10d.object_collectives import all_gather_object
from .._process_group.reduce_op import ReduceOp

__all__ = ["broadcast_coalesced", "find_common_rank", "verify_param_shapes", "BROADCAST_BUCKET_BYTES"]

#: PyTorch's ``_DEFAULT_BROADCAST_BUCKET_SIZE`` for DDP's module-state broadcasts.
BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024


def verify_param_shapes(params: Sequence[torch.Tensor], names: Sequence[str], group) -> None:
    """Raise ``RuntimeError`` on every rank if any rank's parameter count, shapes or dtypes differ."""
    mine = [(tuple(p.shape), str(p.dtype)) for p in params]
    everyone: list = [None] * group.size()
    all_gather_object(everyone, mine, group=group)
    me = group.rank()
    for rank, theirs in enumerate(everyone):
        if len(theirs) != len(mine):
            raise RuntimeError(
                f"DDP expects same model across all ranks, but Rank {me} has {len(mine)} params, while rank "
                f"{rank} has inconsistent {len(theirs)} params.")
        for i, (a, b) in enumerate(zip(mine, theirs)):
            if a != b:
                raise RuntimeError(
                    f"[{me}]: params[{i}] ({names[i]}) in this process with sizes {list(a[0])} and dtype {a[1]} "
                    f"appears not to match sizes {list(b[0])} and dtype {b[1]} of the same param in process "
                    f"{rank}. DDP expects the same model on every rank.")


def broadcast_coalesced(tensors: Sequence[torch.Tensor], src: int, group,
                        buffer_size: int = BROADCAST_BUCKET_BYTES) -> None:
    """Broadcast ``tensors`` from group rank ``src``, in place, in few collectives.

    Every rank must pass tensors of the same shapes and dtypes in the same order.
    """
    chunks: list[list[torch.Tensor]] = []
    open_chunks: dict[torch.dtype, tuple[list[torch.Tensor], list[int]]] = {}
    for t in tensors:
        chunk, size = open_chunks.setdefault(t.dtype, ([], [0]))
        chunk.append(t)
        size[0] += t.nbytes
        if size[0] >= buffer_size:
            chunks.append(chunk)
            del open_chunks[t.dtype]
    chunks.extend(chunk for chunk, _ in open_chunks.values())
    for chunk in chunks:
        with torch.no_grad():  # a lone contiguous tensor is broadcast in place (flatten's view)
            flat = flatten([t.detach() for t in chunk])
            broadcast(flat, group_src=src, group=group)
            unflatten_into(flat, [t.data for t in chunk])


def find_common_rank(group, candidate: bool) -> int:
    """The highest group rank for which ``candidate`` is True on that rank (a MAX all-reduce)."""
    value = torch.tensor([group.rank() if candidate else -1], dtype=torch.int64)
    all_reduce(value, op=ReduceOp.MAX, group=group)
    rank = int(value.item())
    if rank < 0:
        raise RuntimeError("DDP: no rank qualified as the authoritative rank (every rank passed False)")
    return rank
