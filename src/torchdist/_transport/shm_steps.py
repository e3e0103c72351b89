"""Collective *steps*: the synchronization that shared-memory collectives are built from.

A collective on shared memory is a sequence of steps. In each step every rank
writes what it contributes into its own data regions, then *publishes* the step
(stores its step counter), then waits until every rank has published it, and
then reads what it needs from the peers' regions. The counter is global to the
group (it keeps counting across collectives), and regions alternate between
two sets by the parity of the step:

- data of step ``g`` is written into the set ``g % 2`` before publishing ``g``;
- it is read after the wait for ``g``, and at the latest before publishing ``g + 1``
  (in the next step's read phase, or the op's trailing reads, which finish
  before the next op publishes anything).

Why this is safe with one synchronization per step: a rank overwrites set
``g % 2`` only in step ``g + 2``, which it starts after every rank published
``g + 1``, i.e. after every rank finished reading step ``g``. So no rank is ever
more than one step ahead of any other, and a small collective costs exactly one
synchronization (the prototype measured 4-6 us per op at world 2 this way).

The first step of every collective also carries the op's fingerprint (seq, op
kind, dtype, element count, root, reduce op) in the line of its parity, and a
64-bit digest of it next to the step counter; after the first wait every rank
compares everyone's digest (the poll just brought that line into its cache, so
this costs no memory traffic: at world 4 reading three fingerprint lines cost
more than the op's data), and on a difference reads the fingerprints, so ranks
that disagree about the op raise on every rank, naming both ops, before any
data is read.

Regions per rank: ``IN`` (two sets) and ``OUT`` (two sets), ``chunk`` bytes each;
what an algorithm puts where is its business (``_algorithms/shm_direct.py``).
"""

from __future__ import annotations

import os
import time
from typing import Callable

import torch

from ..errors import DistBackendError
from .thread_roles import on_worker_thread
from .framing import OpFingerprint
from .shm_board import ADDRESS, DIGEST, FP, FP_LINE, LINE, STEP, Board
from .shm_heap import SymmetricHeap

__all__ = ["Steps", "IN", "OUT"]

IN, OUT = 0, 2
_SPIN_POLLS = 64  # polls between clock reads while spinning
#: Bounds of the polling budget before blocking (s): see ``Steps._wait``.
_BUDGET_MIN = 5e-6
_BUDGET_MAX = float(os.environ.get("TORCHDIST_SHM_SPIN_US", "200")) * 1e-6
_BUDGET_MAX_OVERSUBSCRIBED = 1e-3
#: Yields between the polling budget and blocking.
_YIELDS = int(os.environ.get("TORCHDIST_SHM_YIELDS", "1"))
#: Waits longer than this are not worth spinning through: a blocked rank's CPU goes to
#: the peer (or to other work) and a sleeper is favoured by the scheduler when woken.
_SPIN_PAYS_S = 50e-6
_PROBE_EVERY = 64


class Steps:
    """One rank's side of the step protocol over a :class:`~.shm_board.Board`."""

    def __init__(self, board: Board) -> None:
        self.board = board
        self.rank, self.size = board.rank, board.size
        self.chunk = board.layout.chunk
        self.step = 0  # the last step this rank published
        self._peer_ctl = [(j, board.ctl[j]) for j in board.peers]
        self._check: tuple | None = None  # (record, digest) to compare after the next wait
        self._views: dict[tuple, torch.Tensor] = {}
        self._budget_max = _BUDGET_MAX_OVERSUBSCRIBED if board.oversubscribed else _BUDGET_MAX
        self._budget = self._budget_max
        self._waits = 0
        #: Called while blocked in a step: the transport moves its pending messages.
        self.pump: Callable[[], object] | None = None

    # -- the protocol ------------------------------------------------------------------
    def begin(self, seq: int, fingerprint: OpFingerprint, aux: int = 0, address: int = 0) -> None:
        """Start a collective: its fingerprint goes with its first step (``aux``: where
        its tensor lives, 0 unless in symmetric memory; ``address``: of the tensor that
        peers read from this process, see :meth:`address_of`)."""
        g = self.step + 1
        if address:
            self.board.me[ADDRESS] = address
        record = (seq, *fingerprint, aux)
        FP.pack_into(self.board.segments[self.rank].buf, (FP_LINE + g % 2) * LINE, *record)
        # hash() of a tuple of ints is the same in every process (only str/bytes hashes
        # are salted), and a signed 64-bit word, as the board's words are.
        digest = hash(record)
        self.board.me[DIGEST + g % 2] = digest
        self._check = (record, digest)

    def sync(self, deadline: float | None) -> None:
        """Publish the next step and wait until every rank has published it."""
        board = self.board
        g = self.step + 1
        # Every data store of this step precedes this store in program order, and
        # x86 makes stores visible in order: whoever sees g sees the data.
        board.me[STEP] = g
        self.step = g
        if self._peer_ctl:
            board.wake(board.peers)
            if self._lagging(g) is not None:
                self._wait(g, deadline)
        if self._check is not None:
            (record, digest), self._check = self._check, None
            word = DIGEST + g % 2
            for j, ctl in self._peer_ctl:
                if ctl[word] != digest:
                    self._compare(g, record)

    def address_of(self, rank: int) -> int:
        """The ``address`` rank ``rank`` passed to ``begin`` for the current collective
        (read after its first ``sync``; valid in that rank's process until the op's last)."""
        return self.board.ctl[rank][ADDRESS]

    def peers_inside(self) -> bool:
        """Whether every peer has published the step this rank publishes next, i.e. is
        already inside the next collective (or broke: running it then raises at once)."""
        g = self.step + 1
        for _, ctl in self._peer_ctl:
            value = ctl[STEP]
            if 0 <= value < g:
                return False
        return True

    def _lagging(self, g: int) -> int | None:
        """A peer that has not published step ``g`` yet, or None; raises if one never will.

        A broken peer's counter reads ``-1 - step``: a step it published before its
        group broke still counts (its data for it stands), so an op whose every step
        was published completes, and the break is the next op's error."""
        for j, ctl in self._peer_ctl:
            value = ctl[STEP]
            if value < g:
                if value < 0:
                    if -1 - value >= g:
                        continue
                    raise self.board.aborted(j)
                return j
        return None

    def _wait(self, g: int, deadline: float | None) -> None:
        """Poll for a budget, then block on the doorbell (``Board.idle``).

        The budget adapts (as adaptive mutexes do) to how long the peers took last
        time (``_adapt``). With ranks <= cores and peers running in parallel, a peer
        arrives within microseconds and we never sleep. When the machine has other
        work, a lagging peer is often descheduled for a whole time slice, possibly
        on *our* core, where spinning only keeps it off the CPU and burns the
        scheduler credit that gets a sleeper back on the CPU quickly when woken:
        then the budget drops to a few microseconds, we yield once (the peer runs
        if it shares our core) and block (its publish rings our doorbell). Measured
        on the loaded VM (load 5 on 2 cores): spinning through such waits made a
        small all-reduce 200-300 us, blocking at once ~60 us. With more ranks than
        cores every failed poll yields (the prototype measured spinning there up to
        17x slower).

        On an engine's worker thread nothing is polled: the op runs there because its
        caller went on computing, and a polling worker holds the GIL that the caller's
        autograd hooks need and takes the core (or hyperthread) beside the caller's.
        In one timeline of DDP on a 16-core host (buckets on the workers), a rank's
        backward layers took 3.4-5.5 ms with polling against 2.5 ms without (run to
        run noise there was about 35%), and without polling every bucket but the
        last was reduced before the next one was ready. The worker's waits do not
        adapt the budget, which is the caller's.
        """
        if on_worker_thread():
            self._block(g, deadline)
            return
        start = time.perf_counter()
        if not self._poll(g, start + self._budget, self.board.oversubscribed):
            self._block(g, deadline)
        self._adapt(time.perf_counter() - start)

    def _block(self, g: int, deadline: float | None) -> None:
        """Yield, then block on the doorbell until every rank published ``g``."""
        for _ in range(_YIELDS):  # a peer descheduled on our core runs now, if it can
            os.sched_yield()
            if self._lagging(g) is None:
                return
        pump, board = self.pump, self.board

        def ready() -> bool:
            if board.broken:  # our own group broke under us (aborted from another thread)
                raise board.aborted(self.rank)
            # A peer may be blocked sending us a message (a ring full of a P2P transfer
            # posted before this collective): keep the rings moving while we wait.
            if pump is not None:
                pump()
            return self._lagging(g) is None
        self.board.idle(ready, deadline, lambda: [j for j, ctl in self._peer_ctl if 0 <= ctl[STEP] < g],
                        polls=False)

    def _poll(self, g: int, until: float, yields: bool) -> bool:
        """Poll until every rank published ``g`` (True) or ``until`` passes (False)."""
        lagging, polls = self._lagging, 1 if yields else _SPIN_POLLS
        while True:
            for _ in range(polls):
                if lagging(g) is None:
                    return True
            if yields:
                os.sched_yield()
            if time.perf_counter() > until:
                return False

    def _adapt(self, waited: float) -> None:
        """Next budget: twice the last wait if it was short enough for spinning to pay
        (``_SPIN_PAYS_S``), else the minimum; every ``_PROBE_EVERY`` waits one full
        budget, to notice when a loaded machine has become quiet again.

        With more ranks than cores the budget stays full: those polls yield, so the
        core goes to a peer that shares it, and a long wait there is our own peers
        taking turns, not a reason to block (measured at world 4 on 2 cores: 8-byte
        all-reduce 80-87 us for the slowest rank, against 88-92 us, and up to 213 us
        while the budget adapted, blocking and paying wake-ups)."""
        if self.board.oversubscribed:
            return
        self._waits += 1
        if self._waits % _PROBE_EVERY == 0:
            self._budget = self._budget_max
        elif waited < _SPIN_PAYS_S:
            self._budget = min(max(2 * waited, _BUDGET_MIN), self._budget_max)
        else:
            self._budget = _BUDGET_MIN

    def _compare(self, g: int, mine: tuple) -> None:
        """Raise on the first peer whose fingerprint for step ``g`` differs from ``mine``."""
        board = self.board
        offset = (FP_LINE + g % 2) * LINE
        for j in board.peers:
            theirs = FP.unpack_from(board.segments[j].buf, offset)
            if theirs != mine:
                raise self._mismatch(mine, j, theirs)

    def _mismatch(self, mine: tuple, peer: int, theirs: tuple) -> DistBackendError:
        names = self.board.names
        ours = f"collective #{mine[0]} {OpFingerprint(*mine[1:6]).describe()}"
        other = f"collective #{theirs[0]} {OpFingerprint(*theirs[1:6]).describe()}"
        if mine[:6] == theirs[:6]:  # aux: where the tensors live (see shm_heap.SymmetricHeap.describe)
            detail = (f"both ranks are at {ours}, but rank {names[self.rank]} passed "
                      f"{SymmetricHeap.explain(mine[6])} and rank {names[peer]} {SymmetricHeap.explain(theirs[6])}; "
                      "a collective on symmetric memory needs every rank's tensor at the same place")
        else:
            detail = f"rank {names[self.rank]} is at {ours} but rank {names[peer]} is at {other}"
        return DistBackendError(
            f"{self.board.label}: collective mismatch at sequence number {mine[0]}: {detail}. Every rank must "
            "call the same collectives, in the same order, with the same dtype, element count, root and "
            "reduce op.")

    # -- regions -----------------------------------------------------------------------
    def _region(self, rank: int, index: int, dtype: torch.dtype) -> torch.Tensor:
        key = (rank, index, dtype)
        view = self._views.get(key)
        if view is None:
            board = self.board
            raw = torch.frombuffer(board.segments[rank].buf, dtype=torch.uint8, count=self.chunk,
                                   offset=board.layout.region(index))
            view = raw.view(dtype)
            self._views[key] = view
        return view

    def slots(self, dtype: torch.dtype, numel: int, offset: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every rank's IN region, elements ``offset`` to ``offset + numel``, per parity:
        ``slots[parity][rank]``.

        Cached per (dtype, numel, offset): slicing a tensor costs ~1 us, more than the
        data movement of a small collective."""
        key = (dtype, numel, offset)
        views = self._views.get(key)
        if views is None:
            if (offset + numel) * torch.empty(0, dtype=dtype).element_size() > self.chunk:
                raise ValueError(f"{numel} elements at {offset} of {dtype} do not fit a {self.chunk}-byte region")
            if len(self._views) > 512:
                self._views.clear()
            views = tuple([self._region(j, IN + parity, dtype)[offset:offset + numel] for j in range(self.size)]
                          for parity in (0, 1))
            self._views[key] = views
        return views

    def mine(self, kind: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's region ``kind`` (IN/OUT) for the step about to be published."""
        return self._region(self.rank, kind + (self.step + 1) % 2, dtype)

    def theirs(self, rank: int, kind: int, dtype: torch.dtype) -> torch.Tensor:
        """Rank ``rank``'s region ``kind`` of the step last published (read after ``sync``)."""
        return self._region(rank, kind + self.step % 2, dtype)

    def close(self) -> None:
        self._views.clear()
        self._peer_ctl = []
