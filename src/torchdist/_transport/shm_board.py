"""The shared board of a shared-memory group: every rank's segment, mapped by every rank.

Each rank owns one segment (``shm_segment.Segment``) and maps all the others. A
segment is laid out in 64-byte lines, so that words written by different ranks
never share a cache line::

    line  0      step       word 0: collective steps this rank has published (see
                            shm_steps); negative (-1 - step) once the rank's group broke.
                            Words 1-2: a digest of the op's fingerprint, per step parity,
                            read with the step in one cache line. Word 3: the address,
                            in the rank's own process, of the tensor its current
                            collective reads peers' memory from (``cross_memory``)
    line  1      sleeping   1 while the rank blocks on its doorbell
    lines 2-3    op         the fingerprint of its current collective, one line per
                            step parity: seq, op, dtype, numel, root, redop, aux
    line  4      doorbell   a process-shared semaphore peers post to wake it
    line  5      reason     length of the abort reason, whose UTF-8 bytes fill lines 6-13
    line 14      process    the owner's pid, the segment's address in the owner's process,
                            and whether the owner could read every peer's memory with
                            ``process_vm_readv`` (1) or not (2): written before setup's
                            barrier, read after it
    line 16+2j   head       ring j -> owner: bytes rank j has written (written by j)
    line 17+2j   tail       ring j -> owner: bytes the owner has consumed (written by owner)
    CTRL + j*RING           ring j -> owner: RING bytes of message stream (shm.py)
    DATA + k*CHUNK          four data regions, IN0 IN1 OUT0 OUT1 (shm_steps.py)

Memory ordering (x86-64 only, see ``shm_segment.supported``): counters are
monotonic int64 words on their own lines, written with one aligned 8-byte store
and read with one load (a ``memoryview`` of format ``q``). x86 keeps stores in
program order and loads in program order, so "write data, then store the
counter" on one side and "load the counter, then read data" on the other is
enough; so is "read data, then store the counter" against "load the counter,
then overwrite" (loads are not reordered with later stores). The one reordering
x86 allows, a store with a later load, matters only for sleeping; see
:meth:`Board.idle`.

Waiting: poll the counters, then block on the doorbell (a wake-up costs 30-300 us
on the 2-core VM, so only long waits block). How long to poll is the caller's
choice: collective steps adapt it (``Steps._wait``); message waits poll for
``POLL_S``, yielding on every failed poll. While blocked, check the
deadline and, every ``LIVENESS_S``, whether the awaited peers are still alive.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from typing import Callable

from ..errors import DistBackendError, DistNetworkError
from . import cross_memory
from .base import PeerTimeout
from .shm_segment import Doorbell, Segment, clean_stale_segments, fence, wait_until_all_mapped

__all__ = ["Board", "Layout", "BLOCK_S", "STEP", "DIGEST", "ADDRESS", "SLEEP", "FP_LINE", "RING_LINE", "FP", "LINE"]

logger = logging.getLogger(__name__)

LINE = 64
_Q = LINE // 8  # int64 words per line
STEP, SLEEP, FP_LINE, BELL_LINE, REASON_LINE, PROC_LINE, RING_LINE = 0, 1, 2, 4, 5, 14, 16
DIGEST = 1  # word of line 0 (STEP's) holding the fingerprint digest of parity 0; parity 1 at DIGEST + 1
ADDRESS = 3  # word of line 0: the current collective's tensor address, for peers reading it (cross_memory)
_PROC = struct.Struct("<qqq")  # line PROC_LINE: pid, segment address in the owner's process, can read (1) or not (2)
_PID, _CAN_READ = PROC_LINE * _Q, PROC_LINE * _Q + 2
_REASON_BYTES = 8 * LINE
#: seq, op, dtype, numel, root, redop, aux: one line per step parity.
FP = struct.Struct("<qqqqqqq")
_PAGE = 4096

#: Message waits poll this long, yielding, before blocking on the doorbell (s). Short:
#: on a loaded machine the peer we wait for may need our core (measured: 1 ms of
#: polling made a small P2P ping-pong 1.1 ms per message at load 5, against ~0.1 ms).
POLL_S = float(os.environ.get("TORCHDIST_SHM_POLL_US", "50")) * 1e-6
#: Longest single sleep on the doorbell: bounds how late a deadline or a death is seen
#: (``Board.block_s``, shorter while a transport has a companion).
BLOCK_S = 0.05
#: How often a blocked waiter checks that the peers it waits for are alive (s).
LIVENESS_S = 0.1


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class Layout:
    """Offsets of one segment for a group of ``size`` ranks."""

    def __init__(self, size: int, ring: int, chunk: int) -> None:
        if ring % _PAGE or chunk % _PAGE:
            raise ValueError(f"ring ({ring}) and chunk ({chunk}) sizes must be multiples of {_PAGE}")
        self.size, self.ring, self.chunk = size, ring, chunk
        self.ctrl = _round_up((RING_LINE + 2 * size) * LINE, _PAGE)
        self.rings = self.ctrl
        self.data = self.rings + size * ring
        self.total = self.data + 4 * chunk

    def head(self, sender: int) -> int:
        """Index (in int64 words) of the head counter of ring ``sender`` -> owner."""
        return (RING_LINE + 2 * sender) * _Q

    def tail(self, sender: int) -> int:
        return (RING_LINE + 2 * sender + 1) * _Q

    def ring_offset(self, sender: int) -> int:
        return self.rings + sender * self.ring

    def region(self, index: int) -> int:
        """Byte offset of data region ``index`` (0, 1: IN by parity; 2, 3: OUT by parity)."""
        return self.data + index * self.chunk


class Board:
    """All segments of one group, as seen by ``rank``: ``ctl[j]`` are rank j's words."""

    def __init__(self, store, rank: int, size: int, timeout: float, names: list[int], label: str,
                 ring: int, chunk: int) -> None:
        self.rank, self.size = rank, size
        self.names, self.label = names, label
        self.layout = Layout(size, ring, chunk)
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
        #: More ranks than cores: yield on every failed poll instead of spinning.
        self.oversubscribed = size > cores
        #: A core per rank for its compute and one for its engine's worker: then work
        #: handed to the worker runs beside the caller's compute instead of taking turns.
        self.spare_cores = 1 < size and 2 * size <= cores
        self.segments: list[Segment] = []
        self._bootstrap(store, timeout)
        self.ctl = [memoryview(s.buf)[:self.layout.ctrl].cast("q") for s in self.segments]
        self.bells = [Doorbell(s.address + BELL_LINE * LINE) for s in self.segments]
        self.me = self.ctl[rank]
        self.peers = [j for j in range(size) if j != rank]
        #: Every rank's pid if every rank can read every peer's memory (``cross_memory``), else None.
        self.pids: list[int] | None = None
        if size > 1 and all(view[_CAN_READ] == 1 for view in self.ctl):
            self.pids = [view[_PID] for view in self.ctl]
        self.broken = False
        self.block_s = BLOCK_S

    # -- setup -------------------------------------------------------------------------
    def _bootstrap(self, store, timeout: float) -> None:
        """Create mine, publish its path, map everyone's, then unlink mine once all mapped."""
        layout, rank = self.layout, self.rank
        if rank == 0:
            clean_stale_segments()
        own = Segment.create(layout.total, rank, self.label)
        try:
            Doorbell(own.address + BELL_LINE * LINE).init()
            _PROC.pack_into(own.buf, PROC_LINE * LINE, os.getpid(), own.address, 0)
            store.set(f"shm/segment/{rank}", own.path)
            segments = []
            for peer in range(self.size):
                if peer == rank:
                    segments.append(own)
                    continue
                path = store.get(f"shm/segment/{peer}").decode()
                segments.append(Segment.attach(path, layout.total, self.label, self.names[peer]))
            self.segments = segments
            can_read = all(self._can_read(segment) for segment in segments if segment is not own)
            _PROC.pack_into(own.buf, PROC_LINE * LINE, os.getpid(), own.address, 1 if can_read else 2)
            # Everyone has mapped everything: the names can go. From here on, the kernel
            # frees the memory when the last process that maps it exits, however it exits.
            wait_until_all_mapped(store, "shm/mapped", self.rank, segments, timeout, self.names, self.label)
        except BaseException:
            for segment in self.segments or [own]:
                segment.close()
            raise
        own.unlink()
        logger.debug("%s: rank %d mapped %d segments of %d bytes", self.label, self.names[rank],
                     self.size, layout.total)

    @staticmethod
    def _can_read(segment: Segment) -> bool:
        """Whether ``process_vm_readv`` reads the pid its owner wrote into its segment."""
        pid, base, _ = _PROC.unpack_from(segment.buf, PROC_LINE * LINE)
        return cross_memory.probe(pid, base + PROC_LINE * LINE, pid.to_bytes(8, "little", signed=True))

    # -- waking ------------------------------------------------------------------------
    def wake(self, peers) -> None:
        """After publishing: ring the doorbell of each of ``peers`` that sleeps.

        The fence orders our counter store before the loads of their flags (the
        sleeper does the mirror image: flag store, fence, counter load), so either
        we see its flag or it sees our counter: no lost wake-up (Dekker's pattern).
        """
        fence()
        ctl = self.ctl
        for j in peers:
            if ctl[j][SLEEP * _Q]:
                self.bells[j].ring()

    def interrupt(self) -> None:
        self.bells[self.rank].ring()

    def idle(self, ready: Callable[[], bool], deadline: float | None, waiting_on: Callable[[], list[int]],
             polls: bool = True, yields: bool = False) -> None:
        """Return once ``ready()``; poll, then block on our doorbell (see the module docstring).

        Raises :class:`PeerTimeout` at ``deadline`` naming ``waiting_on()``, or
        :class:`DistNetworkError` if one of them died. ``ready`` raises on aborts.
        """
        if polls:
            start = time.perf_counter()
            yield_ = yields or self.oversubscribed
            while time.perf_counter() - start < POLL_S:
                if ready():
                    return
                if yield_:
                    os.sched_yield()
        me, bell = self.me, self.bells[self.rank]
        next_check = time.monotonic() + LIVENESS_S
        while True:
            me[SLEEP * _Q] = 1
            fence()  # our flag store before the loads in ready(): see wake()
            if ready():
                me[SLEEP * _Q] = 0
                return
            now = time.monotonic()
            nap = self.block_s if deadline is None else min(self.block_s, deadline - now)
            if nap > 0:
                bell.sleep(nap)
            me[SLEEP * _Q] = 0
            if ready():
                return
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                peers = waiting_on()
                self.check_alive(peers)  # a dead peer, not a slow one, if it is gone
                raise PeerTimeout(f"{self.label}: timed out waiting for ranks "
                                  f"{[self.names[p] for p in peers]}", peers)
            if now >= next_check:
                self.check_alive(waiting_on())
                next_check = now + LIVENESS_S

    def sleep_once(self, timeout: float, ready: Callable[[], bool]) -> None:
        """Block up to ``timeout`` unless ``ready()`` (the engine's idle progress)."""
        me = self.me
        me[SLEEP * _Q] = 1
        fence()
        try:
            if not ready() and timeout > 0:
                self.bells[self.rank].sleep(timeout)
        finally:
            me[SLEEP * _Q] = 0

    # -- liveness and aborts -----------------------------------------------------------
    def check_alive(self, peers: list[int]) -> None:
        for peer in peers:
            if peer != self.rank and not self.segments[peer].owner_alive():
                raise self.lost(peer)

    def lost(self, peer: int) -> DistBackendError | DistNetworkError:
        """The error for a peer that is gone: the reason of a rank that broke first, if
        one did (a rank that raised may exit before its peers notice), else its loss."""
        first_abort = self.first_abort()
        if first_abort is not None:
            return first_abort
        name = self.names[peer]
        return DistNetworkError(
            f"{self.label}: rank {self.names[self.rank]} lost rank {name}: it is gone "
            "(it destroyed the group, exited or was killed while this rank waited for it). See "
            f"rank {name}'s log for the cause.")

    def aborted(self, peer: int) -> DistBackendError:
        """The error for a peer whose step counter went negative."""
        ctl = self.ctl[peer]
        length = min(ctl[REASON_LINE * _Q], _REASON_BYTES)
        start = (REASON_LINE + 1) * LINE
        reason = bytes(self.segments[peer].buf[start:start + length]).decode("utf-8", "replace")
        return DistBackendError(f"{self.label}: rank {self.names[self.rank]}: the group was aborted by rank "
                                f"{self.names[peer]}: {reason}")

    def first_abort(self) -> DistBackendError | None:
        """The error of the lowest peer whose step counter went negative, if any."""
        for j in self.peers:
            if self.ctl[j][STEP * _Q] < 0:
                return self.aborted(j)
        return None

    def check_aborts(self) -> None:
        first_abort = self.first_abort()
        if first_abort is not None:
            raise first_abort

    def publish_abort(self, reason: str) -> None:
        """Tell every peer this rank's group broke: reason first, then the negative counter."""
        if self.broken:
            return
        self.broken = True
        data = reason.encode("utf-8", "replace")[:_REASON_BYTES]
        start = (REASON_LINE + 1) * LINE
        self.segments[self.rank].buf[start:start + len(data)] = data
        self.me[REASON_LINE * _Q] = len(data)
        self.me[STEP * _Q] = -1 - max(self.me[STEP * _Q], 0)
        fence()
        for j in self.peers:
            self.bells[j].ring()

    def close(self) -> None:
        for view in self.ctl:
            view.release()
        self.ctl = []
        for segment in self.segments:
            segment.close()
        self.segments = []
