"""Element-wise reductions with torch's in-place ops, applied piece by piece.

A *combiner* is ``combine(dst, src)``: ``dst = dst (op) src`` in place, both tensors
of one dtype and shape. Torch's kernels release the GIL, so a reduction overlaps
with the kernel moving the next bytes. The process-group layer maps its reduce ops
onto these names: AVG and PREMUL_SUM are SUM plus a scaling: PREMUL_SUM's before
the reduction, AVG's as a *finisher* (``Finish``) handed to all-reduce.

Algorithms reduce received data *as it arrives*: :class:`PieceReducer` is an
``on_data`` callback that combines each newly complete ~1 MiB piece of a receive
buffer into its destination, so the reduction of the last piece is all that is
left when the last byte lands.

Unsigned 16/32/64-bit integers have no arithmetic kernels on CPU: SUM, PRODUCT
and the bitwise ops run on the same bits viewed as signed (two's complement
arithmetic is the same modulo 2**n); MIN and MAX flip the sign bit so signed
comparison orders the values as unsigned ones.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["Combine", "Finish", "Average", "average", "combiner", "commutes", "PieceReducer", "PIECE_BYTES"]

Combine = Callable[[torch.Tensor, torch.Tensor], None]
#: ``finish(piece)``: applied in place, exactly once, to every fully reduced piece
#: before it is shared (AVG's division). An all-reduce applies it where each piece
#: is finished by one rank (1/p of the elements per rank, while they are in cache)
#: instead of in a pass over the whole tensor afterwards.
Finish = Callable[[torch.Tensor], None]


def average(piece: torch.Tensor, size: int) -> None:
    """AVG's division of a reduced ``piece`` by the group ``size``, in place (integers: floor)."""
    if piece.dtype.is_floating_point or piece.dtype.is_complex:
        if size & (size - 1) == 0:  # x * 2**-k is x / 2**k, bit for bit, and ~10x faster here
            piece.mul_(1.0 / size)
        else:
            piece.div_(size)
    elif piece.dtype is not torch.bool:
        piece.div_(size, rounding_mode="floor")


class Average:
    """AVG's finisher (``Finish``): ``average(piece, size)``."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, piece: torch.Tensor) -> None:
        average(piece, self.size)


#: Reduce received data in pieces of this many bytes (measured: 256 KiB-4 MiB were
#: all within noise; 1 MiB keeps the last, unoverlapped piece short).
PIECE_BYTES = 1 << 20

_SIGNED = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def _sum(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.add_(src)


def _product(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.mul_(src)


def _min(dst: torch.Tensor, src: torch.Tensor) -> None:
    torch.minimum(dst, src, out=dst)


def _max(dst: torch.Tensor, src: torch.Tensor) -> None:
    torch.maximum(dst, src, out=dst)


def _band(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.bitwise_and_(src)


def _bor(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.bitwise_or_(src)


def _bxor(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.bitwise_xor_(src)


_COMBINERS: dict[str, Combine] = {
    "SUM": _sum, "PRODUCT": _product, "MIN": _min, "MAX": _max,
    "BAND": _band, "BOR": _bor, "BXOR": _bxor,
}


def commutes(combine: Combine, dtype: torch.dtype) -> bool:
    """Whether ``a op b`` and ``b op a`` are the same bits. Not for MIN and MAX of
    floats: ``maximum(0.0, -0.0)`` is 0.0 and ``maximum(-0.0, 0.0)`` is -0.0."""
    return not (dtype.is_floating_point and combine in (_min, _max))


def combiner(name: str, dtype: torch.dtype) -> Combine:
    """The in-place combiner for reduce op ``name`` (SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR)."""
    try:
        base = _COMBINERS[name]
    except KeyError:
        raise ValueError(f"no combiner for reduce op {name!r}; known: {sorted(_COMBINERS)}") from None
    signed = _SIGNED.get(dtype)
    if signed is None:
        return base
    if name in ("MIN", "MAX"):
        sign_bit = torch.iinfo(signed).min

        def ordered(dst: torch.Tensor, src: torch.Tensor) -> None:
            d, s = dst.view(signed), src.view(signed)
            d.bitwise_xor_(sign_bit)
            flipped = s.bitwise_xor(sign_bit)
            base(d, flipped)
            d.bitwise_xor_(sign_bit)
        return ordered

    def as_signed(dst: torch.Tensor, src: torch.Tensor) -> None:
        base(dst.view(signed), src.view(signed))
    return as_signed


class PieceReducer:
    """``on_data`` callback: as bytes of ``incoming`` land, combine them with ``acc``.

    By default ``acc = acc op incoming``. With ``into_incoming`` the result goes into
    the receive buffer instead, ``incoming = incoming op acc``: the ring uses it to
    keep a read-only input intact.
    """

    __slots__ = ("acc", "incoming", "combine", "esize", "piece", "done", "into_incoming")

    def __init__(self, acc: torch.Tensor, incoming: torch.Tensor, combine: Combine,
                 into_incoming: bool = False, piece_bytes: int = PIECE_BYTES) -> None:
        self.acc = acc
        self.incoming = incoming
        self.combine = combine
        self.esize = max(incoming.element_size(), 1)
        self.piece = max(piece_bytes // self.esize, 1)
        self.done = 0
        self.into_incoming = into_incoming

    def __call__(self, nbytes: int) -> None:
        ready = nbytes // self.esize
        total = self.incoming.numel()
        if ready - self.done < self.piece and ready < total:
            return
        lo, self.done = self.done, ready
        if self.into_incoming:
            self.combine(self.incoming[lo:ready], self.acc[lo:ready])
        else:
            self.combine(self.acc[lo:ready], self.incoming[lo:ready])
