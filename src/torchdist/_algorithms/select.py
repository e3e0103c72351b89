"""Which algorithm runs each collective, by message size and group size.

The crossovers were measured with ``python benchmarks/bench_collectives.py --sweep``
(all-reduce with each algorithm forced through ``TORCHDIST_ALGO_ALLREDUCE``; TCP over
loopback on the 2-core development VM; median of the slowest rank, best of 2-3
alternating runs). The VM was shared and loaded (load average 4-9) during the
sweep, so single numbers vary by +-30%; the orders of magnitude below held in
every repetition.

all-reduce, world 2, median us (bytes: direct / recursive doubling / ring)::

    8: 229 / 52 / 80      4 KiB: 241 / 53 / 240     32 KiB: 267 / 60 / 266
    128 KiB: 376 / 101 / 321      512 KiB: 742 / 242 / 641      2 MiB: 2800 / 1246 / 2841
    (a later, busier repetition: 8 B 226 / 197 / 234, 4 KiB 239 / 210 / 239)

At p = 2 recursive doubling and ring move the same bytes (n per rank) but ring
takes two steps, so recursive doubling wins up to the largest size swept; the
ring still runs above 4 MiB, where reducing as data arrives and needing only
n/p of scratch pay off.

all-reduce, world 4, median us (direct / recursive doubling / ring)::

    8: 849 / 946 / 693*   4 KiB: 897 / 675 / 591   32 KiB: 1056 / 794 / 723
    128 KiB: 1558 / 1401 / 808   512 KiB: 3400 / 3543 / 1801   2 MiB: 23669 / 13614 / 9666
    (* 2 elements < p: the ring falls back to direct)

so at p = 4 the ring wins from ~32 KiB; below, the three are within noise and
recursive doubling (fewest bytes, no p x n scratch) is used for powers of two,
direct (one step instead of 2 + log2 p) otherwise.

Halving-doubling (Rabenseifner: the ring's bytes in 2 log2 p steps) against the
ring at p = 4, ``TORCHDIST_ALGO_ALLREDUCE`` forced, alternating runs of
``benchmarks/bench_collectives.py --world-sizes 4 --ops all_reduce`` (load 4-6),
tcp median us, ring / halving-doubling, 2-3 runs each (at 16-64 MiB one run of each
algorithm hit a load spike, 1.5-2x slower, and is left out)::

    256 KiB: 1313-1315 / 1166 (1785 beside a test run)      2 MiB: 4465-4597 / 3989-4177
    16 MiB: 29051-34473 / 31868-35501      64 MiB: 123764-133452 / 124225-127858

so halving-doubling is ~10% faster from 256 KiB to 2 MiB and within noise from
16 MiB, where the cost is the kernel's two copies per byte (the same in both),
not the steps: its pairwise steps move twice the ring's bytes each, over one
socket both ways. It runs between the ring threshold and 8 MiB at powers of two
>= 4 (p = 8 not measured on this 2-core VM: it follows p = 4, where the saving is
larger, 6 steps instead of 14); the ring keeps larger messages (n/p of scratch,
not n/2).

=================  ================================  ======================================
collective         small (< threshold)               large
=================  ================================  ======================================
all-reduce         recursive doubling (p = 2^k),     ring reduce-scatter + all-gather;
                   direct (other p)                  halving-doubling below 8 MiB (p = 2^k >= 4)
all-gather         direct (1 step)                   ring
reduce-scatter     direct (1 step)                   ring
broadcast          binomial tree                     pipelined chain (p >= 3)
reduce             binomial tree                     ring reduce-scatter + gather
all-to-all         direct (1 step)                   pairwise exchange
=================  ================================  ======================================

The gather/scatter-style thresholds (32 KiB received from all peers together, 256 KiB
for broadcast) were not swept separately: they follow the all-reduce crossover at p = 4.
"""

from __future__ import annotations

import enum
import os

from .halving_doubling import is_power_of_two

__all__ = ["Algo", "allreduce_algo", "allgather_algo", "reduce_scatter_algo", "broadcast_algo",
           "reduce_algo", "alltoall_pairwise", "CHAIN_SEGMENT"]


class Algo(enum.Enum):
    DIRECT = "direct"
    RECURSIVE_DOUBLING = "recursive_doubling"
    HALVING_DOUBLING = "halving_doubling"
    RING = "ring"
    BINOMIAL = "binomial"
    CHAIN = "chain"


#: Pipeline segment of the chain broadcast (bytes).
CHAIN_SEGMENT = 1 << 20

# Per-message byte thresholds below which the latency-optimal algorithm runs, by group
# size; measured up to 4 (see the docstring). Larger groups take the smaller
# _ALLREDUCE_SMALL_LARGER: the latency algorithms' byte counts grow with the group.
_ALLREDUCE_SMALL = {2: 4 << 20, 3: 32 << 10, 4: 32 << 10}
_ALLREDUCE_SMALL_LARGER = 16 << 10
_GATHER_SMALL = 32 << 10
_BROADCAST_SMALL = 256 << 10
#: Below this, large all-reduces at powers of two >= 4 use halving-doubling. Measured.
_HALVING_DOUBLING_LARGE = 8 << 20


def _forced(name: str) -> Algo | None:
    """``TORCHDIST_ALGO_<COLLECTIVE>=ring`` forces an algorithm (for the benchmark sweep)."""
    value = os.environ.get(f"TORCHDIST_ALGO_{name}")
    return Algo(value) if value else None


def allreduce_algo(nbytes: int, size: int) -> Algo:
    forced = _forced("ALLREDUCE")
    if forced is not None:
        return forced
    threshold = _ALLREDUCE_SMALL.get(size, _ALLREDUCE_SMALL_LARGER)
    if nbytes < threshold or nbytes < size * 64:
        return Algo.RECURSIVE_DOUBLING if is_power_of_two(size) else Algo.DIRECT
    if size >= 4 and is_power_of_two(size) and nbytes < _HALVING_DOUBLING_LARGE:
        return Algo.HALVING_DOUBLING
    return Algo.RING


def allgather_algo(nbytes_per_rank: int, size: int) -> Algo:
    forced = _forced("ALLGATHER")
    if forced is not None:
        return forced
    return Algo.DIRECT if nbytes_per_rank * (size - 1) < _GATHER_SMALL or size <= 2 else Algo.RING


def reduce_scatter_algo(nbytes_per_rank: int, size: int) -> Algo:
    forced = _forced("REDUCE_SCATTER")
    if forced is not None:
        return forced
    return Algo.DIRECT if nbytes_per_rank * (size - 1) < _GATHER_SMALL or size <= 2 else Algo.RING


def broadcast_algo(nbytes: int, size: int) -> Algo:
    forced = _forced("BROADCAST")
    if forced is not None:
        return forced
    return Algo.BINOMIAL if nbytes < _BROADCAST_SMALL or size <= 2 else Algo.CHAIN


def reduce_algo(nbytes: int, size: int) -> Algo:
    forced = _forced("REDUCE")
    if forced is not None:
        return forced
    return Algo.BINOMIAL if nbytes < _ALLREDUCE_SMALL.get(size, _ALLREDUCE_SMALL_LARGER) else Algo.RING


def alltoall_pairwise(nbytes_per_peer: int, size: int) -> bool:
    return nbytes_per_peer * (size - 1) >= _GATHER_SMALL
