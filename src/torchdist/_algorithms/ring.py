"""Ring algorithms: bandwidth-optimal reduce-scatter, all-gather and all-reduce.

Ranks form a ring; at every step rank ``r`` sends one chunk to ``r + 1`` while
receiving another from ``r - 1`` (Patarasuk & Yuan, "Bandwidth optimal all-reduce
algorithms for clusters of workstations", JPDC 2009). With ``n`` bytes in all:

- reduce-scatter: ``p - 1`` steps, ``(p-1)/p * n`` bytes out per rank:
  ``(p-1) alpha + (p-1)/p n beta + (p-1)/p n gamma``;
- all-gather: ``(p-1) alpha + (p-1)/p n beta``;
- all-reduce = reduce-scatter + all-gather: ``2(p-1) alpha + 2(p-1)/p n beta +
  (p-1)/p n gamma``; the beta term is optimal, the alpha term is why small
  messages use ``recursive`` instead.

Chunk bookkeeping: if rank ``r`` sends chunk ``r + k - s`` at step ``s``, it
receives chunk ``r + k - s - 1`` (what its left neighbour sends), and after
``p - 1`` reduce-scatter steps it holds the full reduction of chunk ``r + k + 1``.
Received data is reduced in ~1 MiB pieces as it lands (``PieceReducer``) and
all-gather data is received straight into the output. Every final chunk is
computed by one rank and copied to the others, so all ranks end bit-identical.
"""

from __future__ import annotations

import torch

from .comm import Comm, chunk_bounds
from .reduction import Combine, Finish, PieceReducer

__all__ = ["ring_reduce_scatter", "ring_allgather", "ring_allreduce"]


def ring_reduce_scatter(comm: Comm, chunks: list[torch.Tensor], combine: Combine, owned: int,
                        output: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce ``chunks[i]`` across ranks; this rank ends up with the reduction of
    chunk ``(rank + owned) % p``. Returns the tensor holding it.

    ``output is None``: in place, ``chunks`` are overwritten with partial sums and
    the result is that chunk itself. Otherwise ``chunks`` are left intact (double
    buffered through scratch) and the result is written to ``output``.
    ``owned`` is 1 for all-reduce (then the ring all-gather shares chunk r + 1)
    and 0 for reduce-scatter (rank r gets chunk r).
    """
    p, r = comm.size, comm.rank
    k = owned - 1
    if p == 1:
        if output is not None:
            output.copy_(chunks[0])
            return output
        return chunks[0]
    left, right = (r - 1) % p, (r + 1) % p
    largest = max(c.numel() for c in chunks)
    buffers = 2 if output is not None and p > 2 else 1
    space = comm.scratch(buffers * largest, chunks[0].dtype)
    scratch = [space[i * largest:(i + 1) * largest] for i in range(buffers)]
    outgoing = chunks[(r + k) % p]
    for step in range(p - 1):
        index = (r + k - step - 1) % p
        mine = chunks[index]
        if output is None:  # in place: partial sums accumulate in the chunk itself
            incoming = scratch[0][:mine.numel()]
            reducer = PieceReducer(mine, incoming, combine)
            comm.exchange(right, outgoing, left, incoming, reducer)
            outgoing = mine
        else:  # the last step receives straight into the output
            incoming = output if step == p - 2 else scratch[step % 2][:mine.numel()]
            reducer = PieceReducer(mine, incoming, combine, into_incoming=True)
            comm.exchange(right, outgoing, left, incoming, reducer)
            outgoing = incoming
    return outgoing


def ring_allgather(comm: Comm, pieces: list[torch.Tensor], owned: int) -> None:
    """``pieces[(rank + owned) % p]`` is filled on entry; on return every piece is.

    Pieces may differ in size (list all-gather with per-rank sizes) and are
    received straight into their final place.
    """
    p, r = comm.size, comm.rank
    left, right = (r - 1) % p, (r + 1) % p
    for step in range(p - 1):
        send_index = (r + owned - step) % p
        recv_index = (r + owned - step - 1) % p
        comm.exchange(right, pieces[send_index], left, pieces[recv_index])


def ring_allreduce(comm: Comm, flat: torch.Tensor, combine: Combine, finish: Finish | None = None) -> None:
    """All-reduce the 1-D tensor ``flat`` in place: reduce-scatter, then all-gather."""
    p = comm.size
    if p == 1:
        if finish is not None:
            finish(flat)
        return
    chunks = [flat[a:b] for a, b in chunk_bounds(flat.numel(), p)]
    # reduce-scatter: rank r ends up owning the reduction of chunk r + 1
    owned = ring_reduce_scatter(comm, chunks, combine, owned=1)
    if finish is not None:
        finish(owned)
    # all-gather: pass the finished chunks around the ring
    ring_allgather(comm, chunks, owned=1)
