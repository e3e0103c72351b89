"""Placements: how one mesh dimension lays a tensor out (``Shard(dim)``, ``Replicate()``, ``Partial(op)``).

A DTensor has one placement per mesh dimension. ``Shard(d)`` splits tensor
dimension ``d`` over the ranks of that mesh dimension with torch.chunk's rule
(chunks of ``ceil(n / k)`` rows, so the last ranks may get fewer or zero rows);
``Replicate()`` gives every rank the whole tensor; ``Partial(op)`` gives every
rank a tensor of the full shape whose reduction with ``op`` over the mesh
dimension is the value.

``_StridedShard(dim, split_factor=f)`` (private, as in PyTorch) is the layout that
FSDP2 gives a parameter that tensor parallelism had already sharded on the same
dim: cut ``dim`` into ``f`` torch.chunk pieces, cut each piece into ``k`` chunks,
and rank ``i`` holds chunk ``i`` of every piece, concatenated. Read left to right
over the mesh, ``(_StridedShard(0, split_factor=tp), Shard(0))`` on a ``(dp, tp)``
mesh is "TP shards first, then FSDP shards each TP block" (right to left)::

    rows 0..7, dp=2, tp=2:   rank (dp, tp) = (0, 0): 0-1   (0, 1): 4-5   (1, 0): 2-3   (1, 1): 6-7
"""

from __future__ import annotations

import torch

__all__ = ["Placement", "Shard", "Replicate", "Partial", "_StridedShard", "shard_size_and_offset",
           "shard_indices", "is_shard_like"]

_PARTIAL_OPS = ("sum", "avg", "max", "min", "product")


def shard_size_and_offset(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """Rows ``[offset, offset + length)`` of a dimension of ``size`` rows that chunk ``index`` of ``num_chunks`` holds.

    torch.chunk's rule: every chunk but the last non-empty ones holds ``ceil(size / num_chunks)`` rows.
    """
    full = -(-size // num_chunks) if num_chunks else 0
    start = min(size, full * index)
    return min(size, start + full) - start, start


class Placement:
    """The base of the placements; ``is_*`` ask which one this is."""

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return False


class Shard(Placement):
    """Tensor dimension ``dim`` is split over the mesh dimension, torch.chunk-like (uneven: last ranks get less)."""

    __slots__ = ("dim",)

    def __init__(self, dim: int = 0) -> None:
        self.dim = dim

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __eq__(self, other: object) -> bool:
        return type(other) is Shard and other.dim == self.dim

    def __hash__(self) -> int:
        return hash(("Shard", self.dim))

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"

    def __str__(self) -> str:
        return f"S({self.dim})"

    def __reduce__(self):
        return Shard, (self.dim,)

    @staticmethod
    def local_shard_size_and_offset(curr_local_size: int, num_chunks: int, rank: int) -> tuple[int, int]:
        """(length, offset) of chunk ``rank`` of ``num_chunks`` of a dimension of ``curr_local_size`` rows."""
        return shard_size_and_offset(curr_local_size, num_chunks, rank)

    def _local_shard_size_and_offset(self, curr_local_size: int, num_chunks: int, rank: int) -> tuple[int, int]:
        return shard_size_and_offset(curr_local_size, num_chunks, rank)

    def _split_tensor(self, tensor: torch.Tensor, num_chunks: int, *, with_padding: bool = True,
                      contiguous: bool = True) -> tuple[list[torch.Tensor], list[int]]:
        """``num_chunks`` pieces along ``self.dim`` (empty ones included) and, with ``with_padding``, each zero-padded
        to the largest one's length (what collectives need) with the padding of each (else no pad sizes)."""
        size = tensor.size(self.dim)
        full = -(-size // num_chunks)
        pieces, pads = [], []
        for index in range(num_chunks):
            length, offset = shard_size_and_offset(size, num_chunks, index)
            piece = tensor.narrow(self.dim, offset, length)
            if with_padding:
                pads.append(full - length)
                piece = pad_dim(piece, self.dim, full)
            pieces.append(piece.contiguous() if contiguous else piece)
        return pieces, pads


def pad_dim(tensor: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """``tensor`` zero-padded at the end of ``dim`` to ``length`` rows."""
    missing = length - tensor.size(dim)
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(shape)], dim)


class _StridedShard(Placement):
    """Tensor dimension ``dim`` cut into ``split_factor`` pieces, each split over the mesh dimension; a rank holds
    its chunk of every piece (see the module docstring). Not a ``Shard`` (``is_shard()`` is False), as in PyTorch."""

    __slots__ = ("dim", "split_factor")

    def __init__(self, dim: int, *, split_factor: int = 1, sf: int | None = None) -> None:
        if sf is not None:
            if split_factor != 1:
                raise TypeError("_StridedShard received both split_factor and sf")
            split_factor = sf
        self.dim = dim
        self.split_factor = int(split_factor)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _StridedShard) and other.dim == self.dim and other.split_factor == self.split_factor

    def __hash__(self) -> int:
        return hash((self.dim, self.split_factor))

    def __repr__(self) -> str:
        return f"_StridedShard(dim={self.dim}, sf={self.split_factor})"

    def __str__(self) -> str:
        return f"_S({self.dim}, {self.split_factor})"

    def __reduce__(self):
        return _strided_shard, (self.dim, self.split_factor)

    def indices(self, size: int, num_chunks: int, index: int) -> list[int]:
        """The rows of a dimension of ``size`` rows that chunk ``index`` of ``num_chunks`` holds, in its order."""
        rows: list[int] = []
        for piece_len, piece_start in (shard_size_and_offset(size, self.split_factor, j)
                                       for j in range(self.split_factor)):
            length, offset = shard_size_and_offset(piece_len, num_chunks, index)
            rows.extend(range(piece_start + offset, piece_start + offset + length))
        return rows

    def local_shard_size_and_offset(self, curr_local_size: int, num_chunks: int, rank: int) -> tuple[int, int]:
        """(length, first row) of chunk ``rank``; the first row is -1 for an empty chunk, as in PyTorch."""
        rows = self.indices(curr_local_size, num_chunks, rank)
        return len(rows), rows[0] if rows else -1

    def _local_shard_size_and_offset(self, curr_local_size: int, num_chunks: int, rank: int) -> tuple[int, int]:
        return self.local_shard_size_and_offset(curr_local_size, num_chunks, rank)

    def _split_tensor(self, tensor: torch.Tensor, num_chunks: int, *, with_padding: bool = True,
                      contiguous: bool = True) -> tuple[list[torch.Tensor], list[int]]:
        """The ``num_chunks`` strided chunks along ``self.dim`` and, with ``with_padding``, how many rows each lacks
        to the largest one (the chunks themselves are not padded, as in PyTorch)."""
        size = tensor.size(self.dim)
        pieces = []
        for index in range(num_chunks):
            rows = torch.tensor(self.indices(size, num_chunks, index), dtype=torch.long, device=tensor.device)
            piece = tensor.index_select(self.dim, rows)
            pieces.append(piece.contiguous() if contiguous else piece)
        longest = max((p.size(self.dim) for p in pieces), default=0)
        return pieces, [longest - p.size(self.dim) for p in pieces] if with_padding else []


def _strided_shard(dim: int, split_factor: int) -> _StridedShard:
    return _StridedShard(dim, split_factor=split_factor)


def shard_indices(placement: Placement, size: int, num_chunks: int, index: int) -> list[int]:
    """The rows of a dimension of ``size`` rows that ``placement`` (Shard or _StridedShard) gives chunk ``index``."""
    if isinstance(placement, _StridedShard):
        return placement.indices(size, num_chunks, index)
    length, offset = shard_size_and_offset(size, num_chunks, index)
    return list(range(offset, offset + length))


def is_shard_like(placement: Placement) -> bool:
    """Whether ``placement`` splits a tensor dimension: ``Shard`` or ``_StridedShard``."""
    return isinstance(placement, (Shard, _StridedShard))


class Replicate(Placement):
    """Every rank of the mesh dimension holds the whole tensor."""

    __slots__ = ()

    def is_replicate(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return type(other) is Replicate

    def __hash__(self) -> int:
        return hash("Replicate")

    def __repr__(self) -> str:
        return "Replicate()"

    def __str__(self) -> str:
        return "R"

    def __reduce__(self):
        return Replicate, ()


class Partial(Placement):
    """Every rank holds a full-shape tensor; the value is their reduction with ``reduce_op`` over the mesh dimension."""

    __slots__ = ("reduce_op",)

    def __init__(self, reduce_op: str = "sum") -> None:
        if not isinstance(reduce_op, str) or reduce_op not in _PARTIAL_OPS:
            raise ValueError(f"Partial: reduce_op must be one of {_PARTIAL_OPS}, got {reduce_op!r}")
        self.reduce_op = reduce_op

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return reduce_op is None or reduce_op == self.reduce_op

    def __eq__(self, other: object) -> bool:
        return type(other) is Partial and other.reduce_op == self.reduce_op

    def __hash__(self) -> int:
        return hash(("Partial", self.reduce_op))

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op})"

    def __str__(self) -> str:
        return f"P({self.reduce_op})"

    def __reduce__(self):
        return Partial, (self.reduce_op,)
