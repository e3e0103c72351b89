"""``ProcessGroup``: a set of ranks that run collectives together, and its backend.

Vocabulary, used everywhere in torchdist:

- *global rank*: a process's rank in the default (WORLD) group;
- *group rank*: its index within one group (``group.rank()``);
- *seq*: how many collectives this group has issued on this rank; every member
  issues the same collectives in the same order, so the seq agrees across ranks.

A ProcessGroup owns one :class:`ProcessGroupBackend` (which moves the bytes) and the
bookkeeping users can query: size, rank, name, member ranks, timeout.
"""

from __future__ import annotations

import os
from datetime import timedelta

from ..errors import DistBackendError
from .backend import ProcessGroupBackend
from .work import Work

__all__ = ["ProcessGroup"]

#: Bumped in every child right after fork(): a group made before it belongs to the parent.
#: (A module global read per op: cheaper than asking the kernel for the pid.)
_fork_generation = 0


def _forked() -> None:
    global _fork_generation
    _fork_generation += 1


os.register_at_fork(after_in_child=_forked)


class ProcessGroup:
    """One group of ranks on this process; non-members never hold one."""

    def __init__(
        self,
        backend: ProcessGroupBackend,
        *,
        backend_name: str,
        global_ranks: list[int],
        group_name: str,
        group_desc: str,
        store,
        timeout: timedelta,
    ) -> None:
        self._backend = backend
        self._backend_name = backend_name
        self._global_ranks = list(global_ranks)
        self._group_name = group_name
        self._group_desc = group_desc
        self._store = store
        self._timeout = timeout
        self._shut_down = False
        self._pid = os.getpid()  # the process whose sockets, shared memory and threads these are
        self._generation = _fork_generation
        self.bound_device_id = None  # PyTorch's attribute: the accelerator a group is bound to (none here)

    # -- identity --------------------------------------------------------------------
    def rank(self) -> int:
        return self._backend.rank()

    def size(self) -> int:
        return len(self._global_ranks)

    def name(self) -> str:
        """The backend's name, as PyTorch's ProcessGroup.name() returns it."""
        return self._backend_name

    @property
    def group_name(self) -> str:
        return self._group_name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    @property
    def global_ranks(self) -> list[int]:
        """Group rank i is global rank ``global_ranks[i]``."""
        return list(self._global_ranks)

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
        self._backend.timeout = timeout

    def get_group_store(self):
        return self._store

    @property
    def backend(self) -> ProcessGroupBackend:
        """The backend that moves this group's bytes; raises once the group is shut down,
        and in a forked child, whose ops would interleave with the parent's on the same
        connections and shared memory."""
        if self._shut_down:
            raise DistBackendError(
                f"process group {self._group_name!r} was destroyed; create a new group to communicate"
            )
        if self._generation != _fork_generation:
            raise DistBackendError(
                f"process group {self._group_name!r} (rank {self.rank()}) belongs to process {self._pid}; this "
                f"process ({os.getpid()}) is a fork of it and cannot communicate through it. Start workers with "
                "the 'spawn' method, or fork before init_process_group.")
        return self._backend

    def _get_backend(self, device=None) -> ProcessGroupBackend:
        return self.backend

    def _get_sequence_number_for_group(self) -> int:
        """How many collectives this group has run: equal on all members that kept in step."""
        return self._backend.seq

    # -- lifecycle ---------------------------------------------------------------------
    def barrier(self) -> Work:
        return self.backend.barrier()

    def shutdown(self) -> None:
        if not self._shut_down:
            self._shut_down = True
            self._backend.shutdown()

    def abort(self) -> None:
        if not self._shut_down:
            self._shut_down = True
            self._backend.abort()

    def __repr__(self) -> str:
        return (f"ProcessGroup(name={self._group_name!r}, backend={self._backend_name!r}, "
                f"rank={self.rank()}, size={self.size()})")
