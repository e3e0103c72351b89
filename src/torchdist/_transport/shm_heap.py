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

Allocations live until the group is destroyed: a view can outlive the tensor
that ``allocate`` returned, and its peers must still find it.
"""

from __future__ import annotations

from datetime import timedelta

import torch

from ..errors import DistBackendError
from .shm_segment import Segment

__all__ = ["SymmetricHeap", "Allocation"]

#: Byte offsets are below 2**40 (1 TiB); the allocation index goes above them.
_OFFSET_BITS = 40


class Allocation:
    """Allocation ``index``: every rank's segment of ``nbytes``, mapped here."""

    __slots__ = ("index", "nbytes", "segments", "base", "_bytes")

    def __init__(self, index: int, nbytes: int, segments: list[Segment], rank: int) -> None:
        self.index, self.nbytes, self.segments = index, nbytes, segments
        self.base = segments[rank].address
        # Every rank's memory as a uint8 tensor, made once: slicing is cheap, frombuffer is not.
        self._bytes = [torch.frombuffer(s.buf, dtype=torch.uint8, count=nbytes) for s in segments]

    def of(self, rank: int, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """Rank ``rank``'s bytes ``[offset, offset + nbytes)`` as ``dtype``."""
        return self._bytes[rank][offset:offset + nbytes].view(dtype)

    def close(self) -> None:
        self._bytes = []
        for segment in self.segments:
            segment.close()


class SymmetricHeap:
    """The symmetric allocations of one shared-memory group, as seen by ``rank``."""

    def __init__(self, store, rank: int, size: int, timeout: float, names: list[int], label: str) -> None:
        self.store, self.rank, self.size = store, rank, size
        self.timeout, self.names, self.label = timeout, names, label
        self.allocations: list[Allocation] = []

    def allocate(self, nbytes: int) -> torch.Tensor:
        """Collective: a zero-filled uint8 tensor of ``nbytes`` in symmetric memory."""
        index = len(self.allocations)
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
            self.store.arrive_and_wait(f"symm/{index}/mapped", self.rank, self.size, timedelta(seconds=self.timeout))
        except BaseException:
            for segment in segments or [own]:
                segment.close()
            raise
        own.unlink()
        allocation = Allocation(index, size, segments, self.rank)
        self.allocations.append(allocation)
        return allocation.of(self.rank, 0, nbytes, torch.uint8)

    def find(self, start: int, nbytes: int) -> tuple[Allocation, int] | None:
        """The allocation holding the bytes ``[start, start + nbytes)`` of this process's
        memory (a contiguous tensor's ``data_ptr()``), and their offset there."""
        for allocation in self.allocations:
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
        for allocation in self.allocations:
            allocation.close()
        self.allocations = []
