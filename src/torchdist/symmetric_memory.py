"""Symmetric memory on CPU: tensors that the ranks of a one-host group read from each other.

PyTorch offers this for CUDA (``torch.distributed._symmetric_memory``); torchdist
offers it for shared memory. ``empty`` is collective over the group: every rank
gets a tensor of the same shape in a segment that all the group's ranks map.
Collectives of that group on such tensors (all_reduce, broadcast,
all_gather_into_tensor into one, reduce_scatter_tensor from one) read the peers'
data where it lies instead of copying it through the transport's buffers first. Any other use of the tensor is
that of an ordinary CPU tensor.

    buf = torchdist.symmetric_memory.empty(1 << 24, dtype=torch.float32)
    buf.copy_(grads)
    torchdist.all_reduce(buf)      # no copy into shared memory

Every rank must call ``empty`` in the same order with the same arguments, and pass
the same tensor (same allocation, same offset) to a collective: a rank that passes
an ordinary tensor while another passes a symmetric one raises on every rank.
On each rank the memory is released when no tensor over it is left (views
included), or when the group is destroyed.
"""

from __future__ import annotations

import math

import torch

from ._c10d._args import member_group
from ._process_group.process_group import ProcessGroup

__all__ = ["empty", "is_symmetric"]


def empty(*size, dtype: torch.dtype | None = None, group: ProcessGroup | None = None) -> torch.Tensor:
    """A zero-filled tensor in the group's symmetric memory (collective over ``group``)."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    dtype = dtype or torch.get_default_dtype()
    pg = member_group(group, "symmetric_memory.empty", refuse=True)
    backend = pg.backend
    allocate = getattr(backend, "allocate_symmetric", None)
    if allocate is None:
        raise RuntimeError(
            f"symmetric_memory.empty: the group's backend is {type(backend).__name__} ({pg.name()!r}); symmetric "
            "memory needs every rank of the group on one host, on backend 'shm' (or 'auto'/'gloo', which "
            "pick it there).")
    numel = math.prod(size)
    raw = allocate(numel * torch.empty(0, dtype=dtype).element_size())
    return raw.view(dtype).view(size)


def is_symmetric(tensor: torch.Tensor, group: ProcessGroup | None = None) -> bool:
    """Whether all of ``tensor`` lies in the group's symmetric memory (contiguous tensors only)."""
    pg = member_group(group, "symmetric_memory.is_symmetric")
    heap = getattr(getattr(pg.backend, "_transport", None), "heap", None) if pg is not None else None
    if heap is None or not tensor.is_contiguous():
        return False
    return heap.find(tensor.data_ptr(), tensor.nbytes) is not None
