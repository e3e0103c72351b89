"""Entry points a backend calls: one function per collective, algorithm chosen by ``select``.

Every function works on flat (1-D, contiguous) tensors or lists of them, in the
group's rank numbering, over a :class:`~torchdist._algorithms.comm.Comm`. Reduce
ops arrive as combiners (see ``reduction``); all-reduce also takes AVG's division as
a finisher, the other scalings are the caller's business.
"""

from __future__ import annotations

import torch

from . import direct, halving_doubling, recursive, ring, tree
from .comm import Comm, gather_pieces
from .reduction import Combine, Finish
from .select import (CHAIN_SEGMENT, Algo, allgather_algo, allreduce_algo, alltoall_pairwise,
                     broadcast_algo, reduce_algo, reduce_scatter_algo)

__all__ = ["allreduce", "broadcast", "reduce", "allgather", "allgather_into", "reduce_scatter", "alltoall",
           "gather", "scatter", "barrier"]


def allreduce(comm: Comm, flat: torch.Tensor, combine: Combine, finish: Finish | None = None) -> None:
    """``finish`` (see ``reduction.Finish``): the ring and halving-doubling apply it to
    the chunk each rank owns between their two phases; the others, where every rank
    ends with the whole result, to all of it."""
    algo = allreduce_algo(flat.nbytes, comm.size)
    if algo is Algo.HALVING_DOUBLING and not halving_doubling.is_power_of_two(comm.size):
        algo = Algo.RING
    if comm.size == 1:
        pass
    elif algo is Algo.RING and flat.numel() >= comm.size:
        return ring.ring_allreduce(comm, flat, combine, finish)
    elif algo is Algo.HALVING_DOUBLING:
        return halving_doubling.halving_doubling_allreduce(comm, flat, combine, finish)
    elif algo is Algo.RECURSIVE_DOUBLING:
        recursive.recursive_doubling_allreduce(comm, flat, combine)
    else:
        direct.direct_allreduce(comm, flat, combine)
    if finish is not None:
        finish(flat)


def broadcast(comm: Comm, flat: torch.Tensor, root: int) -> None:
    if comm.size == 1:
        return
    if broadcast_algo(flat.nbytes, comm.size) is Algo.CHAIN:
        tree.chain_broadcast(comm, flat, root, CHAIN_SEGMENT)
    else:
        tree.binomial_broadcast(comm, flat, root)


def reduce(comm: Comm, flat: torch.Tensor, root: int, combine: Combine) -> None:
    if comm.size == 1:
        return
    if reduce_algo(flat.nbytes, comm.size) is Algo.RING and flat.numel() >= comm.size:
        tree.ring_reduce(comm, flat, root, combine)
    else:
        tree.binomial_reduce(comm, flat, root, combine)


def allgather(comm: Comm, pieces: list[torch.Tensor]) -> None:
    """``pieces[rank]`` holds this rank's data on entry; all pieces are filled on return."""
    if comm.size == 1:
        return
    largest = max(piece.nbytes for piece in pieces)
    if allgather_algo(largest, comm.size) is Algo.RING:
        ring.ring_allgather(comm, pieces, owned=0)
    else:
        direct.direct_allgather(comm, pieces)


def allgather_into(comm: Comm, output: torch.Tensor, input: torch.Tensor) -> None:
    """All-gather into one flat ``output``: rank j's ``input`` lands at ``j * input.numel()``."""
    allgather(comm, gather_pieces(output, input, comm.size, comm.rank))


def reduce_scatter(comm: Comm, chunks: list[torch.Tensor], combine: Combine, output: torch.Tensor) -> None:
    """``output`` = reduction over ranks of ``chunks[rank]``; ``chunks`` are not modified."""
    if comm.size == 1:
        output.copy_(chunks[0])
        return
    largest = max(chunk.nbytes for chunk in chunks)
    if reduce_scatter_algo(largest, comm.size) is Algo.RING:
        ring.ring_reduce_scatter(comm, chunks, combine, owned=0, output=output)
    else:
        direct.direct_reduce_scatter(comm, chunks, combine, output)


def alltoall(comm: Comm, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
    largest = max(t.nbytes for t in inputs)
    direct.alltoall(comm, outputs, inputs, pairwise=alltoall_pairwise(largest, comm.size))


def gather(comm: Comm, outputs: list[torch.Tensor] | None, input: torch.Tensor, root: int) -> None:
    direct.gather(comm, outputs, input, root)


def scatter(comm: Comm, output: torch.Tensor, inputs: list[torch.Tensor] | None, root: int) -> None:
    direct.scatter(comm, output, inputs, root)


def barrier(comm: Comm) -> None:
    tree.barrier(comm)
