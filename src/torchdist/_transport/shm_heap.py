"""Symmetric memory: tensors that every rank of a shared-memory group can read directly.

``SymmetricHeap.allocate(nbytes)`` is collective: every rank of the group creates a
segment of ``nbytes`` (``shm_segment.Segment``), publishes its path through the
store, maps every peer's, and unlinks its own once all have mapped (the same
lifetime rules as the board's segments: nothing leaks, SIGKILL included). The
caller gets a tensor over its own segment; allocation ``k`` exists on every rank
with the same size, so a tensor at byte offset ``o`` of allocation ``k`` has a
twin at the same place on every peer (a *symmetric* address, as in OpenSHMEM or
NVSHMEM).

A collective on such a tensor can skip the copy into the board's regions: each
rank reads its peers' tensors where they are (``_algorithms/shm_direct``). Ranks
must agree on that: ``describe`` gives the (allocation, offset) code that goes
into the op's fingerprint, so a rank passing a symmetric tensor while another
passes an ordinary one (or another allocation, or another offset) raises on
every rank before anything is read.

An allocation lives as long as any tensor over this rank's segment does (views
included: the ``mmap`` stays alive while a tensor's storage exports it), then this
rank unmaps its own segment and its peers' (a finalizer on the ``mmap``); the
group's destruction unmaps the peers' segments of those still alive. The ranks free
independently: a peer's mapping of a segment keeps its memory until that peer
frees too, and a tensor freed on one rank but still passed to a collective on
another is caught by the fingerprint (the freed rank passes an ordinary tensor).
Once mapped, no allocation holds a lock descriptor: only the mappings' own.
"""

from __future__ import annotations

import mmap
import weakref

import torch

from ..errors import DistBackendError
from .shm_segment import Segment, wait_until_all_mapped

__all__ = ["SymmetricHeap", "Allocation"]

#: Byte offsets are below 2**40 (1 TiB); the allocation index goes above them.
_OFFSET_BITS = 40


class Allocation:
    """Allocation ``index``: this rank's segment (held weakly: by its tensors) and its peers' (held here)."""

    __slots__ = ("index", "nbytes", "base", "rank", "_own", "_peers", "_peer_bytes", "finalizer")

    def __init__(self, index: int, nbytes: int, own: Segment, peers: dict[int, Segment], rank: int) -> None:
        self.index, self.nbytes, self.rank = index, nbytes, rank
        self.base = own.address
        self._own: "weakref.ref[mmap.mmap]" = weakref.ref(own.buf)
        self._peers = peers
        # Every peer's memory as a uint8 tensor, made once: slicing is cheap, frombuffer is not.
        self._peer_bytes = {j: torch.frombuffer(seg.buf, dtype=torch.uint8, count=nbytes) for j, seg in peers.items()}
        self.finalizer: weakref.finalize | None = None

    def of(self, rank: int, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """Rank ``rank``'s bytes ``[offset, offset + nbytes)`` as ``dtype`` (this rank's: while
        a tensor over them lives, as a collective's argument does)."""
        if rank == self.rank:
            whole = torch.frombuffer(self._own(), dtype=torch.uint8, count=self.nbytes)
        else:
            whole = self._peer_bytes[rank]
        return whole[offset:offset + nbytes].view(dtype)

    def close(self) -> None:
        """Unmap the peers' segments (this rank's goes with its last tensor)."""
        if self.finalizer is not None:
            self.finalizer.detach()
        self._peer_bytes = {}
        for segment in self._peers.values():
            segment.close()
        self._peers = {}


def _release(allocations: dict[int, Allocation], index: int) -> None:
    """Finalizer of an allocation's own mapping: its last tensor is gone."""
    allocation = allocations.pop(index, None)
    if allocation is not None:
        allocation.close()


class SymmetricHeap:
    """The symmetric allocations of one shared-memory group, as seen by ``rank``."""

    def __init__(self, store, rank: int, size: int, timeout: float, names: list[int], label: str) -> None:
        self.store, self.rank, self.size = store, rank, size
        self.timeout, self.names, self.label = timeout, names, label
        self.allocations: dict[int, Allocation] = {}  # the live ones, by index
        self._count = 0  # allocations made: the next index (the same on every rank)

    def allocate(self, nbytes: int) -> torch.Tensor:
        """Collective: a zero-filled uint8 tensor of ``nbytes`` in symmetric memory."""
        index = self._count
        self._count += 1
        size = max(nbytes, 1)  # mmap refuses empty mappings
        own = Segment.create(size, self.rank, self.label)
        segments: list[Segment] = []
        try:
            self.store.set(f"symm/{index}/{self.rank}", f"{nbytes} {own.path}")
            for peer in range(self.size):
                if peer == self.rank:
                    segments.append(own)
                    continue
                theirs, path = self.store.get(f"symm/{index}/{peer}").decode().split(" ", 1)
                if int(theirs) != nbytes:
                    raise DistBackendError(
                        f"{self.label}: symmetric allocation #{index}: rank {self.names[self.rank]} asked for "
                        f"{nbytes} bytes but rank {self.names[peer]} for {theirs}. Every rank must allocate "
                        "the same sizes in the same order.")
                segments.append(Segment.attach(path, size, self.label, self.names[peer]))
            wait_until_all_mapped(self.store, f"symm/{index}/mapped", self.rank, segments, self.timeout, self.names,
                                  self.label)
        except BaseException:
            for segment in segments or [own]:
                segment.close()
            raise
        own.unlink()
        for segment in segments:  # nobody watches these locks (the board's segments tell liveness)
            segment.drop_lock()
        tensor = torch.frombuffer(own.buf, dtype=torch.uint8, count=size)[:nbytes]
        allocation = Allocation(index, size, own, {j: seg for j, seg in enumerate(segments) if j != self.rank},
                                self.rank)
        allocation.finalizer = weakref.finalize(own.buf, _release, self.allocations, index)
        self.allocations[index] = allocation
        return tensor

    def find(self, start: int, nbytes: int) -> tuple[Allocation, int] | None:
        """The allocation holding the bytes ``[start, start + nbytes)`` of this process's
        memory (a contiguous tensor's ``data_ptr()``), and their offset there."""
        for allocation in tuple(self.allocations.values()):  # (a finalizer may drop one meanwhile)
            if allocation.base <= start and start + nbytes <= allocation.base + allocation.nbytes:
                return allocation, start - allocation.base
        return None

    @staticmethod
    def describe(allocation: Allocation, offset: int) -> int:
        """The fingerprint code of a symmetric address (0 is left for ordinary tensors)."""
        return ((allocation.index + 1) << _OFFSET_BITS) | offset

    @staticmethod
    def explain(code: int) -> str:
        if code == 0:
            return "an ordinary tensor"
        return f"symmetric allocation #{(code >> _OFFSET_BITS) - 1} at byte offset {code & ((1 << _OFFSET_BITS) - 1)}"

    def close(self) -> None:
        for allocation in tuple(self.allocations.values()):
            allocation.close()
        self.allocations.clear()
