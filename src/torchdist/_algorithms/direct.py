"""Direct algorithms: every rank talks to every peer it needs in a single step.

All sends and receives of the op are posted at once and progressed together by
the transport, so there is no ordering to deadlock on, whatever the sizes. Costs
(``n`` = bytes of one rank's contribution):

- ``direct_allreduce``: ``alpha + (p-1) n beta`` out per rank, then ``(p-1) n gamma``.
  One step of latency: the best choice for tiny messages at any ``p``. Every rank
  folds the contributions in rank order (``((x0 op x1) op x2) ...``), the same
  expression everywhere, so results are bit-identical;
- ``direct_allgather`` / ``direct_reduce_scatter``: ``alpha + (p-1) n beta``;
- ``alltoall``: direct (one step) for small messages, pairwise for large ones:
  at step ``s`` send to ``r + s`` and receive from ``r - s``, ``(p-1) (alpha + n beta)``,
  which keeps one transfer per direction in flight;
- ``gather`` / ``scatter``: linear at the root, ``(p-1) (alpha + n beta)`` there.
"""

from __future__ import annotations

import torch

from .comm import Comm
from .reduction import Combine

__all__ = ["direct_allreduce", "direct_allgather", "direct_reduce_scatter", "alltoall", "gather", "scatter"]


def _fold(slots: list[torch.Tensor], combine: Combine, out: torch.Tensor) -> None:
    """``out = slots[0] op slots[1] op ...``, left to right (same order on every rank).

    The fold accumulates into ``slots[0]`` (scratch, or ``out`` itself)."""
    acc = slots[0]
    for slot in slots[1:]:
        combine(acc, slot)
    if acc is not out:
        out.copy_(acc)


def direct_allreduce(comm: Comm, flat: torch.Tensor, combine: Combine) -> None:
    """All-reduce the 1-D tensor ``flat`` in place in one exchange step."""
    p, r = comm.size, comm.rank
    if p == 1:
        return
    scratch = comm.scratch(p * flat.numel(), flat.dtype).view(p, flat.numel())
    slots = [flat if peer == r else scratch[peer] for peer in range(p)]
    transfers = [comm.recv(peer, slots[peer]) for peer in range(p) if peer != r]
    transfers += [comm.send(peer, flat) for peer in range(p) if peer != r]
    comm.wait(*transfers)
    _fold(slots, combine, flat)  # rank 0 accumulates in place, the others in scratch[0]


def direct_allgather(comm: Comm, pieces: list[torch.Tensor]) -> None:
    """``pieces[rank]`` is filled on entry; every rank's piece is filled on return."""
    p, r = comm.size, comm.rank
    transfers = [comm.recv(peer, pieces[peer]) for peer in range(p) if peer != r]
    transfers += [comm.send(peer, pieces[r]) for peer in range(p) if peer != r]
    comm.wait(*transfers)


def direct_reduce_scatter(comm: Comm, chunks: list[torch.Tensor], combine: Combine,
                          output: torch.Tensor) -> None:
    """``output`` = reduction over ranks of their ``chunks[rank]``; ``chunks`` stay intact."""
    p, r = comm.size, comm.rank
    mine = chunks[r]
    scratch = comm.scratch(p * mine.numel(), mine.dtype).view(p, mine.numel())
    transfers = [comm.recv(peer, scratch[peer]) for peer in range(p) if peer != r]
    transfers += [comm.send(peer, chunks[peer]) for peer in range(p) if peer != r]
    scratch[r].copy_(mine)
    comm.wait(*transfers)
    _fold(list(scratch), combine, output)


def alltoall(comm: Comm, outputs: list[torch.Tensor], inputs: list[torch.Tensor], pairwise: bool) -> None:
    """``outputs[j]`` receives rank j's ``inputs[rank]``; pieces may differ in size."""
    p, r = comm.size, comm.rank
    outputs[r].copy_(inputs[r])
    if not pairwise:
        transfers = [comm.recv(peer, outputs[peer]) for peer in range(p) if peer != r]
        transfers += [comm.send(peer, inputs[peer]) for peer in range(p) if peer != r]
        comm.wait(*transfers)
        return
    for step in range(1, p):
        dst, src = (r + step) % p, (r - step) % p
        comm.exchange(dst, inputs[dst], src, outputs[src])


def gather(comm: Comm, outputs: list[torch.Tensor] | None, input: torch.Tensor, root: int) -> None:
    """The root's ``outputs[j]`` receives rank j's ``input``."""
    p, r = comm.size, comm.rank
    if r != root:
        comm.wait(comm.send(root, input))
        return
    transfers = [comm.recv(peer, outputs[peer]) for peer in range(p) if peer != r]
    outputs[r].copy_(input)
    comm.wait(*transfers)


def scatter(comm: Comm, output: torch.Tensor, inputs: list[torch.Tensor] | None, root: int) -> None:
    """Rank j's ``output`` receives the root's ``inputs[j]``."""
    p, r = comm.size, comm.rank
    if r != root:
        comm.wait(comm.recv(root, output))
        return
    transfers = [comm.send(peer, inputs[peer]) for peer in range(p) if peer != r]
    output.copy_(inputs[r])
    comm.wait(*transfers)
