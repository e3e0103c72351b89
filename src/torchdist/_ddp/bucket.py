"""Gradient buckets: which parameters share one all-reduce, and their flat tensors.

DDP does not all-reduce gradient by gradient: small collectives are dominated by
their fixed cost, and one collective over all gradients cannot start before
backward has ended. Following Li et al., "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training" (VLDB 2020), section 3.2.3, gradients are
packed into *buckets* of up to ``bucket_cap_mb``: the collective of a bucket
starts as soon as all of its gradients are ready, so communication of the later
layers overlaps the backward computation of the earlier ones.

Bucket order (section 3.2.3, "Parameter-to-Bucket Mapping"): gradients become
ready roughly in the reverse order of the forward pass, so the first assignment
walks the parameters in reverse order; after the first iteration the buckets are
rebuilt in the order the gradients actually arrived (see ``Reducer``). The first
bucket is kept small (1 MiB) so that the first collective starts early.

``GradBucket`` is what communication hooks receive; its API is PyTorch's.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["Bucket", "GradBucket", "assign_buckets"]


def assign_buckets(params: Sequence[torch.Tensor], order: Sequence[int], limits: Sequence[int]) -> list[list[int]]:
    """Group the parameter indices of ``order`` into buckets of at most ``limits`` bytes.

    Walks ``order`` and appends each parameter to the open bucket of its dtype; a
    bucket is closed once it holds ``limit`` bytes or more, and the next bucket of
    that dtype gets the next limit (the last limit repeats). Buckets come out in
    the order they were closed, then the ones left open, so they follow
    ``order``. A parameter with sparse gradients would need its own bucket; DDP
    densifies them, so they are treated like any other parameter.
    """
    open_buckets: dict[torch.dtype, list[int]] = {}
    sizes: dict[torch.dtype, int] = {}
    limit_index: dict[torch.dtype, int] = {}
    result: list[list[int]] = []
    for index in order:
        p = params[index]
        key = p.dtype
        bucket = open_buckets.setdefault(key, [])
        bucket.append(index)
        sizes[key] = sizes.get(key, 0) + p.numel() * p.element_size()
        limit = limits[min(limit_index.get(key, 0), len(limits) - 1)]
        if sizes[key] >= limit:
            result.append(bucket)
            open_buckets[key] = []
            sizes[key] = 0
            limit_index[key] = limit_index.get(key, 0) + 1
    result.extend(b for b in open_buckets.values() if b)
    return result


class Bucket:
    """One bucket: its parameters, their flat gradient tensor, and this iteration's progress."""

    def __init__(self, index: int, param_indices: list[int], params: list[torch.Tensor]) -> None:
        self.index = index
        self.param_indices = param_indices
        self.params = params
        numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        self.offsets: list[int] = []
        self.views: list[torch.Tensor] = []  # views[k]: params[k]'s gradient inside buffer
        offset = 0
        for p in params:
            self.offsets.append(offset)
            self.views.append(self.buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        self.pending = len(params)  # parameters not ready yet in this iteration
        self.work = None  # the default all-reduce's Work, or
        self.future: torch.futures.Future | None = None  # the comm hook's Future

    def reset(self) -> None:
        self.pending = len(self.params)
        self.work = None
        self.future = None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def __repr__(self) -> str:
        return f"Bucket({self.index}, params={self.param_indices}, {self.nbytes} bytes)"


class GradBucket:
    """A bucket as a communication hook sees it (PyTorch's ``dist.GradBucket``).

    ``buffer()`` is the flattened gradients of ``parameters()``; with no comm hook
    DDP would all-reduce it (averaged). ``gradients()`` are views of the buffer,
    one per parameter, shaped like it.
    """

    def __init__(self, index: int, buffer: torch.Tensor, parameters: list[torch.Tensor],
                 offsets: list[int], is_last: bool) -> None:
        self._index = index
        self._buffer = buffer
        self._parameters = parameters
        self._offsets = offsets
        self._is_last = is_last

    def index(self) -> int:
        """The bucket's index; bucket 0 holds the gradients that arrive first."""
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the bucket's flat tensor (same number of elements)."""
        if buffer.numel() != self._buffer.numel():
            raise ValueError(f"GradBucket.set_buffer: bucket {self._index} holds {self._buffer.numel()} elements, "
                             f"got a tensor of {buffer.numel()}")
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        return [self._buffer[o:o + p.numel()].view(p.shape) for p, o in zip(self._parameters, self._offsets)]

    def parameters(self) -> list[torch.Tensor]:
        return list(self._parameters)

    def is_last(self) -> bool:
        """True for the last bucket to be reduced in an iteration."""
        return self._is_last

    def __repr__(self) -> str:
        return f"GradBucket(index={self._index}, numel={self._buffer.numel()}, params={len(self._parameters)})"
