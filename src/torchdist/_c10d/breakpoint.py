"""``breakpoint(rank)``: a debugger on one rank while every other rank waits for it.

The debugger reads ``/dev/stdin`` rather than ``sys.stdin``: a launcher's
worker (``torchdist-run``, multiprocessing) has its ``sys.stdin`` closed or
redirected, while ``/dev/stdin`` is still the terminal the job was started from.
The other ranks wait in a barrier of the default group; every group's timeout
is raised first (``timeout_s``) so that the barrier does not time out while
someone is typing, as PyTorch does.
"""

from __future__ import annotations

import logging
import pdb
import sys
from datetime import timedelta

from .collectives import barrier
from .init import get_rank
from .world import WORLD

__all__ = ["breakpoint"]

logger = logging.getLogger(__name__)

#: Calls seen so far per call site (file, line), for ``skip``.
_calls: dict[tuple[str, int], int] = {}


class _TerminalPdb(pdb.Pdb):
    """``pdb.Pdb`` that talks to the job's terminal (``/dev/stdin``) whatever ``sys.stdin`` is."""

    def interaction(self, *args, **kwargs) -> None:
        saved = sys.stdin
        try:
            with open("/dev/stdin") as sys.stdin:
                super().interaction(*args, **kwargs)
        finally:
            sys.stdin = saved


def breakpoint(rank: int = 0, skip: int = 0, timeout_s: float | None = 3600) -> None:  # noqa: A001 - torch's name
    """Stop in the debugger on ``rank``; every other rank waits until it continues.

    ``skip``: let the first ``skip`` calls from this line pass (PyTorch keys its count on
    ``traceback.format_exc()``, the same for every call site outside an ``except``; here
    each call site counts on its own). ``timeout_s``: every group's new timeout, so that
    the waiting ranks do not time out during the session (None: keep them).
    """
    if skip > 0:
        caller = sys._getframe(1)
        site = (caller.f_code.co_filename, caller.f_lineno)
        _calls[site] = _calls.get(site, 0) + 1
        if _calls[site] <= skip:
            logger.warning("Skip the breakpoint, counter=%d", _calls[site])
            return
    if timeout_s is not None:
        for group in list(WORLD.groups.values()):
            group.set_timeout(timedelta(seconds=timeout_s))
    if get_rank() == rank:
        debugger = _TerminalPdb()
        debugger.message(f"\n!!! ATTENTION !!!\n\nType 'up' to get to the frame that called "
                         f"dist.breakpoint(rank={rank}); the other ranks wait here until you continue ('c').\n")
        debugger.set_trace()  # stops at the barrier below: stepping on from there leaves it for the caller
    barrier()
