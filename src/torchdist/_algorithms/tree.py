"""Rooted algorithms (broadcast, reduce) and the barrier.

Ranks are renumbered relative to the root, ``v = (rank - root) mod p``.

- ``binomial_broadcast``: ``v`` receives from ``v - 2**k`` (its highest set bit)
  and sends to ``v + 2**j`` for smaller ``j``: ``ceil(log2 p) (alpha + n beta)``.
  Best for small messages.
- ``chain_broadcast``: a pipeline ``v -> v + 1`` in ``segment``-byte messages;
  each rank forwards a segment as soon as it has landed:
  ``(p - 2 + n/s) (alpha + s beta)``, i.e. about ``n beta`` for large ``n``.
- ``binomial_reduce``: the mirror image of the binomial broadcast, reducing on the
  way up: ``ceil(log2 p) (alpha + n beta + n gamma)``.
- ``ring_reduce``: ring reduce-scatter, then every rank sends its finished chunk to
  the root: ``p alpha + 2 (p-1)/p n beta``: for large messages.
- ``barrier``: dissemination (Hensgen, Finkel & Manber 1988): in round ``k`` send
  an empty message to ``r + 2**k`` and receive one from ``r - 2**k``;
  ``ceil(log2 p)`` rounds, after which every rank has heard from every other.
"""

from __future__ import annotations

import torch

from .._transport.base import EMPTY, Transfer
from .comm import Comm, chunk_bounds
from .direct import gather
from .reduction import Combine
from .ring import ring_reduce_scatter

__all__ = ["binomial_broadcast", "chain_broadcast", "binomial_reduce", "ring_reduce", "barrier"]


def binomial_broadcast(comm: Comm, flat: torch.Tensor, root: int) -> None:
    p = comm.size
    v = (comm.rank - root) % p
    mask = 1
    while mask < p:
        if v & mask:
            comm.wait(comm.recv((v - mask + root) % p, flat))
            break
        mask <<= 1
    sends = []
    mask >>= 1
    while mask > 0:
        if v + mask < p:
            sends.append(comm.send((v + mask + root) % p, flat))
        mask >>= 1
    comm.wait(*sends)


def chain_broadcast(comm: Comm, flat: torch.Tensor, root: int, segment: int) -> None:
    """Pipelined chain; ``segment`` is in bytes."""
    p = comm.size
    if flat.numel() == 0 or p <= 2:  # nothing to pipeline
        binomial_broadcast(comm, flat, root)
        return
    v = (comm.rank - root) % p
    esize = max(flat.element_size(), 1)
    pieces = [flat[a:b] for a, b in chunk_bounds(flat.numel(), max(1, -(-flat.numel() * esize // segment)))]
    nxt = (comm.rank + 1) % p if v < p - 1 else None
    if v == 0:
        comm.wait(*[comm.send(nxt, piece) for piece in pieces])
        return
    forwarded: list[Transfer] = []

    def forward_when_complete(piece: torch.Tensor):
        def on_data(nbytes: int) -> None:
            if nbytes == piece.numel() * esize:  # landed whole: pass it on at once
                forwarded.append(comm.send(nxt, piece))
        return on_data

    prev = (comm.rank - 1) % p
    receives = [comm.recv(prev, piece, forward_when_complete(piece) if nxt is not None else None)
                for piece in pieces]
    comm.wait(*receives)
    comm.wait(*forwarded)


def binomial_reduce(comm: Comm, flat: torch.Tensor, root: int, combine: Combine) -> None:
    """Reduce into the root's ``flat``; other ranks' ``flat`` is left intact."""
    p = comm.size
    v = (comm.rank - root) % p
    acc, scratch = flat, None
    mask = 1
    while mask < p:
        if v & mask:
            comm.wait(comm.send((v - mask + root) % p, acc))
            return
        child = v + mask
        if child < p:
            if scratch is None:
                scratch = torch.empty_like(flat)
                if v != 0:  # non-roots keep their input: accumulate in a copy
                    acc = flat.clone()
            comm.wait(comm.recv((child + root) % p, scratch))
            combine(acc, scratch)
        mask <<= 1


def ring_reduce(comm: Comm, flat: torch.Tensor, root: int, combine: Combine) -> None:
    """Reduce into the root's ``flat`` by ring reduce-scatter plus a gather of the chunks."""
    chunks = [flat[a:b] for a, b in chunk_bounds(flat.numel(), comm.size)]
    mine = torch.empty_like(chunks[comm.rank])
    ring_reduce_scatter(comm, chunks, combine, owned=0, output=mine)
    gather(comm, chunks, mine, root)  # the root's chunks are its flat


def barrier(comm: Comm) -> None:
    p, r = comm.size, comm.rank
    distance = 1
    while distance < p:
        receive = comm.recv((r - distance) % p, EMPTY)
        comm.wait(comm.send((r + distance) % p, EMPTY), receive)
        distance <<= 1
