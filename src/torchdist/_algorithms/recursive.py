"""Recursive doubling all-reduce: latency-optimal for small messages.

Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication
Operations in MPICH", IJHPCA 2005, section 4. With ``p' = 2**floor(log2 p)``:

- if ``p`` is not a power of two, each *extra* rank ``r >= p'`` first sends its
  data to ``r - p'`` and gets the result back at the end (2 more steps);
- at step ``i`` rank ``r < p'`` swaps its whole buffer with ``r xor 2**i`` and
  reduces. Cost: ``log2(p') (alpha + n beta + n gamma)`` (+ ``2 (alpha + n beta)``
  for extras): few steps, but the whole buffer every step, hence small messages.

Bit-identical results: the two partners of a step hold the reductions of two
disjoint blocks of ranks; both compute ``lower_block (op) upper_block`` with the
same operand order (the lower block on the left), so both get the same bits even
where the op is not exactly commutative (NaN payloads, signed zeros in MIN/MAX).
The result may sit in the scratch buffer at the end; it is then copied back.
"""

from __future__ import annotations

import torch

from .comm import Comm
from .reduction import Combine

__all__ = ["recursive_doubling_allreduce"]


def recursive_doubling_allreduce(comm: Comm, flat: torch.Tensor, combine: Combine) -> None:
    """All-reduce the 1-D tensor ``flat`` in place."""
    p, r = comm.size, comm.rank
    if p == 1:
        return
    p2 = 1 << (p.bit_length() - 1)
    extra = p - p2
    if r >= p2:  # fold in: hand our data to r - p2, receive the result at the end
        partner = r - p2
        comm.wait(comm.send(partner, flat))
        comm.wait(comm.recv(partner, flat))
        return
    current, other = flat, comm.scratch(flat.numel(), flat.dtype)
    if r < extra:  # absorb the extra rank r + p2 (a higher rank: it goes on the right)
        comm.wait(comm.recv(r + p2, other))
        combine(current, other)
    mask = 1
    while mask < p2:
        partner = r ^ mask
        receive = comm.recv(partner, other)
        comm.wait(comm.send(partner, current), receive)
        if partner > r:  # we hold the lower block: current = current op other
            combine(current, other)
        else:            # the partner's block is lower: other = other op current
            combine(other, current)
            current, other = other, current
        mask <<= 1
    if current is not flat:
        flat.copy_(current)
    if r < extra:
        comm.wait(comm.send(r + p2, flat))
