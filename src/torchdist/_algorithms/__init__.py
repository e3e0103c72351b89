"""Layer 3: collective algorithms, written once over the transport interface.

``comm.Comm`` is all an algorithm sees of the network. ``ring`` (bandwidth-optimal),
``recursive`` (recursive doubling), ``direct`` (one-step exchanges, gather/scatter,
all-to-all) and ``tree`` (broadcast, reduce, barrier) implement the algorithms;
``select`` picks one by message and group size; ``collectives`` is the entry
point backends call; ``reduction`` holds the in-place combiners.
"""

from .comm import Comm, byte_view, chunk_bounds
from .reduction import combiner

__all__ = ["Comm", "byte_view", "chunk_bounds", "combiner"]
