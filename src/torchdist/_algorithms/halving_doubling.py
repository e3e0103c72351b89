"""Rabenseifner's all-reduce: reduce-scatter by recursive halving, all-gather by
recursive doubling, for power-of-two group sizes.

Rabenseifner, "Optimization of Collective Reduction Operations", ICCS 2004;
Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication
Operations in MPICH", IJHPCA 2005, section 4.4. With ``n`` bytes and ``p = 2**k``:

- reduce-scatter by recursive halving: at step ``i`` (``m = p/2, p/4, ..., 1``)
  rank ``r`` swaps half of the range it still reduces with ``r xor m``: it keeps
  the lower half if ``r & m == 0`` and the upper half otherwise, sends the other
  half and reduces what it receives into the half it keeps. After ``log2 p``
  steps rank ``r`` holds the full reduction of chunk ``r``:
  ``log2 p alpha + (p-1)/p n beta + (p-1)/p n gamma``;
- all-gather by recursive doubling, the same steps in reverse (``m = 1, 2, ...,
  p/2``): swap the ``m`` chunks held with the partner's ``m`` chunks, received
  straight into their final place: ``log2 p alpha + (p-1)/p n beta``;
- all-reduce: ``2 log2 p alpha + 2 (p-1)/p n beta + (p-1)/p n gamma``: the
  ring's bytes in ``2 log2 p`` steps instead of ``2 (p - 1)`` (4 instead of 6 at
  p = 4). Every step is a barrier between two ranks, and with more ranks than
  cores each one can cost a time slice: fewer steps is what it buys (measured at
  p = 4 over TCP: ~10% at 256 KiB-2 MiB, nothing from 16 MiB, where the kernel's
  copies dominate; see ``select``). It needs ``n / 2`` of scratch where the ring
  needs ``n / p``, and its steps move ``n / 2, n / 4, ...`` over one socket both
  ways where the ring's move ``n / p`` one way.

Chunks are the ``chunk_bounds`` split of the flat buffer, so the range of chunks a
rank holds is always one contiguous slice: every step is one ``exchange``.
Received data is reduced in ~1 MiB pieces as it lands (``PieceReducer``), in
place into the kept half (``kept = kept op received``). Each final chunk is
computed by exactly one rank (its owner) and copied to the others, so every
rank ends with the same bits, as in the ring.
"""

from __future__ import annotations

import torch

from .comm import Comm, chunk_bounds
from .reduction import Combine, Finish, PieceReducer

__all__ = ["halving_doubling_allreduce", "is_power_of_two"]


def is_power_of_two(size: int) -> bool:
    return size > 0 and size & (size - 1) == 0


def halving_doubling_allreduce(comm: Comm, flat: torch.Tensor, combine: Combine,
                               finish: Finish | None = None) -> None:
    """All-reduce the 1-D tensor ``flat`` in place; ``comm.size`` must be a power of two."""
    p, r = comm.size, comm.rank
    assert is_power_of_two(p), f"halving-doubling needs a power-of-two group, got {p}"
    if p == 1:
        if finish is not None:
            finish(flat)
        return
    bounds = chunk_bounds(flat.numel(), p)

    def span(lo: int, hi: int) -> torch.Tensor:  # chunks lo .. hi - 1, one slice
        return flat[bounds[lo][0]:bounds[hi - 1][1]]

    # reduce-scatter by recursive halving: [lo, hi) is the range still being reduced
    scratch = comm.scratch(bounds[p // 2 - 1][1], flat.dtype)  # the larger (lower) half
    lo, hi, mask = 0, p, p >> 1
    while mask:
        mid = lo + mask
        if r & mask:
            keep, give, lo = span(mid, hi), span(lo, mid), mid
        else:
            keep, give, hi = span(lo, mid), span(mid, hi), mid
        incoming = scratch[:keep.numel()]
        comm.exchange(r ^ mask, give, r ^ mask, incoming, PieceReducer(keep, incoming, combine))
        mask >>= 1
    if finish is not None:
        finish(span(r, r + 1))
    # all-gather by recursive doubling: rank r owns chunk r; swap ever larger ranges
    mask = 1
    while mask < p:
        base = r & ~(mask - 1)
        other = base ^ mask
        comm.exchange(r ^ mask, span(base, base + mask), r ^ mask, span(other, other + mask))
        mask <<= 1
