"""Gradient buckets: which parameters share one all-reduce, and their flat tensors.

DDP does not all-reduce gradient by gradient: small collectives are dominated by
their fixed cost, and one collective over all gradients cannot start before
backward has ended. Following Li et al., "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training" (VLDB 2020), section 3.2.3, gradients are
packed into *buckets* of up to ``bucket_cap_mb``: the collective of a bucket
starts as soon as all of its gradients are ready, so communication of the later
layers overlaps the backward computation of the earlier ones.

Three kinds of bucket:

- *coalesced*: small parameters share a flat tensor that the bucket owns; each
  gradient is copied (divided by the world size) into its slot, and the reduced
  slot is copied back to ``.grad`` (or ``.grad`` is the slot, with
  ``gradient_as_bucket_view``);
- *solo*: a parameter of at least ``solo_param_bytes`` (1 MiB), or one that fills
  its bucket's limit on its own, is reduced alone, in place in its ``.grad``:
  large gradients are already good collective sizes, and the copy in and out
  (2 x 21 MB per step for a 5M-parameter model) costs more than the extra
  collective. The bucket owns a flat tensor only when ``.grad`` cannot be
  reduced in place (no gradient this iteration, not contiguous);
- *sparse*: a parameter whose module makes sparse gradients (``nn.Embedding``
  or ``nn.EmbeddingBag`` with ``sparse=True``), alone, as in PyTorch: its
  ``.grad`` is divided and all-reduced as a sparse COO tensor, which becomes
  the new ``.grad`` (SparseAdam needs one). A sparse gradient anywhere else is
  densified into its slot.

Bucket order (section 3.2.3, "Parameter-to-Bucket Mapping"): gradients become
ready roughly in the reverse order of the forward pass, so the first assignment
walks the parameters in reverse order; after the first iteration the buckets are
rebuilt in the order the gradients actually arrived (see ``Reducer``). A bucket's
index is the position at which it was closed, so buckets complete in index
order: a solo bucket at once, a coalesced one when it reaches its limit (the
first limit is small, 1 MiB, so that the first collective starts early) or, if
it never does, after all others.

``GradBucket`` is what communication hooks receive; its API is PyTorch's.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["Bucket", "GradBucket", "assign_buckets"]


def assign_buckets(params: Sequence[torch.Tensor], order: Sequence[int], limits: Sequence[int],
                   solo_bytes: int | None = None,
                   sparse: Sequence[bool] | None = None) -> list[tuple[list[int], bool]]:
    """Group the parameter indices of ``order`` into buckets: ``[(indices, solo), ...]``.

    Walks ``order``; a parameter of at least ``min(solo_bytes, limit)`` bytes gets
    a solo bucket of its own, closed at once. The others join the open bucket of
    their dtype, which is closed once it holds ``limit`` bytes or more. Each
    closed bucket moves its dtype to the next limit (the last one repeats).
    Buckets come out in the order they were closed, then the ones left open.
    ``solo_bytes=None`` never makes solo buckets. ``sparse[i]``: parameter i
    gets sparse gradients, so a bucket of its own (a solo one), whatever its size;
    such buckets do not move their dtype to the next limit.
    """
    open_buckets: dict[torch.dtype, list[int]] = {}
    sizes: dict[torch.dtype, int] = {}
    limit_index: dict[torch.dtype, int] = {}
    result: list[tuple[list[int], bool]] = []
    for index in order:
        p = params[index]
        key, nbytes = p.dtype, p.nbytes
        if sparse is not None and sparse[index]:
            result.append(([index], True))
            continue
        limit = limits[min(limit_index.get(key, 0), len(limits) - 1)]
        if solo_bytes is not None and nbytes >= min(solo_bytes, limit):
            result.append(([index], True))
            limit_index[key] = limit_index.get(key, 0) + 1
            continue
        bucket = open_buckets.setdefault(key, [])
        bucket.append(index)
        sizes[key] = sizes.get(key, 0) + nbytes
        if sizes[key] >= limit:
            result.append((bucket, False))
            open_buckets[key] = []
            sizes[key] = 0
            limit_index[key] = limit_index.get(key, 0) + 1
    result.extend((b, False) for b in open_buckets.values() if b)
    return result


def _slot(storage: torch.Tensor, param: torch.Tensor, offset: int) -> torch.Tensor:
    """``param``'s slot in a bucket's flat tensor, laid out like ``param`` where its elements
    are dense in some order (a ``channels_last`` weight: its gradient, a bucket view with
    ``gradient_as_bucket_view``, keeps that layout, as in PyTorch), else row-major."""
    expected = 1
    for stride, size in sorted((st, n) for st, n in zip(param.stride(), param.shape) if n != 1):
        if stride != expected:
            return storage[offset:offset + param.numel()].view(param.shape)
        expected *= size
    return storage.as_strided(param.shape, param.stride(), offset)


class Bucket:
    """One bucket: its parameters, the flat tensor reduced this iteration, and progress.

    ``buffer`` is the flat tensor that this iteration's collective reduces: the
    bucket's own (``storage()``) or, for a solo bucket whose ``.grad`` can be
    reduced in place, ``.grad`` flattened (``in_grad`` is then True).
    """

    def __init__(self, index: int, param_indices: list[int], params: list[torch.Tensor], solo: bool = False,
                 allocate: Callable[[int, torch.dtype], torch.Tensor | None] | None = None,
                 sparse: bool = False) -> None:
        """``allocate(numel, dtype)``: where a coalesced bucket's flat tensor lives (None: an
        ordinary tensor). It is called on every rank at the same point (construction), so
        it may be collective; a solo bucket's fallback tensor is allocated on demand,
        on one rank and not another, so it is always an ordinary one."""
        self.index = index
        self.param_indices = param_indices
        self.params = params
        self.solo = solo or sparse
        self.sparse = sparse  # buffer: the parameter's sparse COO gradient, divided
        self.numel = sum(p.numel() for p in params)
        self.dtype = params[0].dtype
        self.offsets: list[int] = []
        offset = 0
        for p in params:
            self.offsets.append(offset)
            offset += p.numel()
        self._storage: torch.Tensor | None = None if self.solo or allocate is None else allocate(self.numel, self.dtype)
        self._views: list[torch.Tensor] = []
        self.buffer: torch.Tensor | None = None if self.solo else self.storage()
        self.in_grad = False  # this iteration's buffer is the solo parameter's .grad
        self.pending = len(params)  # parameters not ready yet in this iteration
        self.work = None  # the default all-reduce's Work, or
        self.future: torch.futures.Future | None = None  # the comm hook's Future

    def storage(self) -> torch.Tensor:
        """The bucket's own flat tensor (allocated on first use for a solo bucket)."""
        if self._storage is None:
            self._storage = torch.zeros(self.numel, dtype=self.dtype, device=self.params[0].device)
        if not self._views:
            self._views = [_slot(self._storage, q, o) for q, o in zip(self.params, self.offsets)]
        return self._storage

    @property
    def views(self) -> list[torch.Tensor]:
        """``views[k]``: ``params[k]``'s slot in the bucket's own flat tensor."""
        self.storage()
        return self._views

    def use_grad(self, grad: torch.Tensor) -> None:
        """Solo bucket: reduce ``grad`` (contiguous, dense) in place this iteration."""
        self.buffer = grad.view(-1)
        self.in_grad = True

    def use_storage(self) -> None:
        self.buffer = self.storage()
        self.in_grad = False

    def reset(self) -> None:
        self.pending = len(self.params)
        self.work = None
        self.future = None
        if self.solo:
            self.buffer = None  # no reference to last iteration's gradient
            self.in_grad = False

    @property
    def nbytes(self) -> int:
        return self.numel * self.params[0].element_size()

    def __repr__(self) -> str:
        kind = "solo" if self.solo else "coalesced"
        return f"Bucket({self.index}, {kind}, params={self.param_indices}, {self.nbytes} bytes)"


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
        if self._buffer.is_sparse:  # a sparse bucket holds one parameter's gradient, shaped like it
            return [self._buffer]
        return [self._buffer[o:o + p.numel()].view(p.shape) for p, o in zip(self._parameters, self._offsets)]

    def parameters(self) -> list[torch.Tensor]:
        return list(self._parameters)

    def is_last(self) -> bool:
        """True for the last bucket to be reduced in an iteration."""
        return self._is_last

    def __repr__(self) -> str:
        return f"GradBucket(index={self._index}, numel={self._buffer.numel()}, params={len(self._parameters)})"
