"""The RRef reference-counting protocol (PyTorch's "RRef notes"), one context per worker.

Vocabulary: the *owner* holds the value; every other holder is a *user* and holds a
*fork*, named by a fork id unique in the job (``(worker id, counter)``, like the RRef
id). The owner keeps the value while its table lists any fork, and drops it when the
last fork is deleted (the owner's own ``RRef`` objects keep it alive locally, as
Python references do).

How forks come and go (O owner, U and V users; every arrow is an RPC)::

    remote(O, f) from O      O: new OwnerRRef whose state waits in local_creations;
                             the request runs f on O's pool and sets that state's value
                             (the value itself, not a copy of it; no fork)
    remote(O, f) from U      U: new UserRRef(F0), unconfirmed
                             U ── create(R, F0, f) ──► O: forks += {F0}, run f
                             U ◄──── ack ───────────── O        U: confirmed
    O sends its RRef to U    O: forks += {F} before sending; U: UserRRef(F), confirmed
    U sends its RRef to V    U: pending_children[F] = the UserRRef (keeps F's parent alive)
                             V: UserRRef(F), unconfirmed
                             V ── add_fork(R, F) ──► O: forks += {F}
                             V ◄──── ack ─────────── O          V: confirmed
                             V ── child_accept(F) ──► U: pending_children -= {F}
    U sends its RRef to O    O resolves it to its OwnerRRef, forks -= {F} (if listed),
                             O ── child_accept(F) ──► U
    a UserRRef is collected  (after confirmation) U ── delete_fork(R, F) ──► O: forks -= {F};
                             no forks left: the table drops the value

Why it is safe: a fork in flight is always covered by a live fork: its sender's
(held by ``pending_children`` until the receiver reported that the owner knows the
new fork), or the owner's table entry itself. Deletions are sent only after
confirmation, so the owner never sees a fork's deletion before its addition from
the same worker. Requests run on a thread pool, so messages may be handled out of
order: adding a fork that the owner does not know yet creates the entry (value
pending); a deletion of an unknown fork is a no-op.

Lifecycle of one RRef object (a fork)::

    user:   UNCONFIRMED ──ack from owner──► CONFIRMED ──collected──► delete sent
              └──collected──► DELETE_PENDING ──ack──► delete sent
    owner:  PENDING (value future not done) ──► READY (value or error)
    both:   ──shutdown──► DELETED (to_here raises "Cannot call to_here() on it after deletion.")

Finalizers run wherever the garbage collector runs, possibly inside locks, so they
only queue the fork; a daemon thread sends the deletions.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections import deque
from typing import Any, Callable

import torch

__all__ = ["RRefContext", "OwnerState", "current", "set_current"]

logger = logging.getLogger(__name__)

GloballyUniqueId = tuple[int, int]  # (worker id, local counter)

_current: "RRefContext | None" = None


def current() -> "RRefContext":
    if _current is None:
        raise RuntimeError("RPC has not been initialized. Call torchdist.rpc.init_rpc first.")
    return _current


def set_current(context: "RRefContext | None") -> None:
    global _current
    _current = context


class OwnerState:
    """The owner's record of one RRef: the value (a Future) and the live forks."""

    __slots__ = ("rref_id", "future", "forks", "__weakref__")

    def __init__(self, rref_id: GloballyUniqueId) -> None:
        self.rref_id = rref_id
        self.future: torch.futures.Future = torch.futures.Future()
        self.forks: set[GloballyUniqueId] = set()


class RRefContext:
    """Owner table, pending children and deletions of one worker.

    ``send(dst, func, args)`` is the internal RPC (returns a Future); the functions
    it names are the module-level handlers at the bottom of this file.
    """

    def __init__(self, worker_id: int, send: Callable[[int, Callable, tuple], torch.futures.Future]) -> None:
        self.worker_id = worker_id
        self.send = send
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.owners: dict[GloballyUniqueId, OwnerState] = {}
        self.pending_children: dict[GloballyUniqueId, Any] = {}
        self.local_creations: dict[GloballyUniqueId, OwnerState] = {}  # remote() to this worker, not yet run
        self.users: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._unconfirmed_deleted: set[GloballyUniqueId] = set()
        self._confirmed: set[GloballyUniqueId] = set()
        self._outbox: deque[tuple[int, GloballyUniqueId, GloballyUniqueId]] = deque()
        self._wake = threading.Event()
        self._stopped = False
        self._inflight = 0  # deletions sent and not yet acknowledged
        self._idle = threading.Condition(self._lock)
        self._deleter = threading.Thread(target=self._delete_loop, daemon=True, name=f"rref-deleter-{worker_id}")
        self._deleter.start()

    def new_id(self) -> GloballyUniqueId:
        return (self.worker_id, next(self._ids))

    # -- owner side ----------------------------------------------------------------------
    def owner_state(self, rref_id: GloballyUniqueId, create: bool = True) -> OwnerState | None:
        with self._lock:
            state = self.owners.get(rref_id)
            if state is None and create:
                state = self.owners[rref_id] = OwnerState(rref_id)
            return state

    def expect_local_creation(self, state: OwnerState) -> None:
        with self._lock:
            self.local_creations[state.rref_id] = state

    def take_local_creation(self, rref_id: GloballyUniqueId) -> OwnerState | None:
        """The state a remote() to this worker waits on; None once the caller gave up on it."""
        with self._lock:
            return self.local_creations.pop(rref_id, None)

    def add_fork(self, state: OwnerState, fork_id: GloballyUniqueId) -> None:
        with self._lock:
            state.forks.add(fork_id)
            self.owners[state.rref_id] = state  # re-listed if its forks had all gone

    def drop_fork(self, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId) -> None:
        with self._lock:
            state = self.owners.get(rref_id)
            if state is None:
                return
            state.forks.discard(fork_id)
            if not state.forks:
                del self.owners[rref_id]  # the last fork is gone: release the value
                logger.debug("worker %d: RRef %s has no forks left; value released", self.worker_id, rref_id)

    # -- user side -----------------------------------------------------------------------
    def hold_child(self, fork_id: GloballyUniqueId, parent: Any) -> None:
        with self._lock:
            self.pending_children[fork_id] = parent

    def release_child(self, fork_id: GloballyUniqueId) -> None:
        with self._lock:
            self.pending_children.pop(fork_id, None)
            self._idle.notify_all()

    def confirm(self, owner: int, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId) -> None:
        """The owner knows ``fork_id``; send its deletion now if it was collected meanwhile."""
        with self._lock:
            self._confirmed.add(fork_id)
            deleted = fork_id in self._unconfirmed_deleted
            self._unconfirmed_deleted.discard(fork_id)
        if deleted:
            self.forget(owner, rref_id, fork_id)

    def on_collected(self, owner: int, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId) -> None:
        """Finalizer of a UserRRef: queue only (may run inside any lock, on any thread)."""
        self._outbox.append((owner, rref_id, fork_id))
        self._wake.set()

    def forget(self, owner: int, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId) -> None:
        with self._lock:
            if self._stopped:
                return
            if fork_id not in self._confirmed:
                self._unconfirmed_deleted.add(fork_id)
                return
            self._confirmed.discard(fork_id)
            self._inflight += 1
        try:
            future = self.send(owner, _rref_delete_fork, (rref_id, fork_id))
        except Exception as exc:  # noqa: BLE001 - the owner is gone; nothing left to release
            logger.debug("worker %d: delete of fork %s failed: %s", self.worker_id, fork_id, exc)
            self._done_one()
            return
        future.add_done_callback(lambda _: self._done_one())

    def _done_one(self) -> None:
        with self._lock:
            self._inflight -= 1
            self._idle.notify_all()

    def _delete_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            while self._outbox:
                self.forget(*self._outbox.popleft())
            if self._stopped:
                return

    # -- shutdown ------------------------------------------------------------------------
    def delete_all_users(self, timeout: float) -> None:
        """Delete every live UserRRef (graceful shutdown) and wait for the owners' acks."""
        for rref in list(self.users):
            rref._mark_deleted()
        self._wake.set()
        with self._lock:
            self._idle.wait_for(lambda: not self.pending_children and self._inflight == 0
                                and not self._outbox and not self._unconfirmed_deleted, timeout)

    def wait_children(self, timeout: float) -> bool:
        with self._lock:
            return self._idle.wait_for(lambda: not self.pending_children, timeout)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            for rref in list(self.users):
                rref._deleted = True
            self.owners.clear()
            self.pending_children.clear()
            self.local_creations.clear()
        self._wake.set()
        self._deleter.join(1.0)


# -- the handlers run on the owner or the parent (module-level: sent by reference) ---------
def _rref_delete_fork(rref_id: GloballyUniqueId, fork_id: GloballyUniqueId) -> None:
    current().drop_fork(rref_id, fork_id)


def _rref_add_fork(rref_id: GloballyUniqueId, fork_id: GloballyUniqueId) -> None:
    ctx = current()
    ctx.add_fork(ctx.owner_state(rref_id), fork_id)


def _rref_child_accept(fork_id: GloballyUniqueId) -> None:
    current().release_child(fork_id)
