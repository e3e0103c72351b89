"""Point-to-point: send/recv, their async forms, ``batch_isend_irecv``, ``monitored_barrier``.

Peers are global ranks (``dst``/``src``) or group ranks (``group_dst``/``group_src``);
messages between a pair of ranks are matched by ``tag``. ``recv`` with no source
takes the first matching message from any rank and returns the sender's rank.
"""

from __future__ import annotations

import time
import warnings
from datetime import timedelta
from typing import Callable

import torch

from .._process_group.process_group import ProcessGroup
from .._process_group.work import Work
from ..errors import DistBackendError
from ._args import Staging, check_tag, check_tensor, group_root, member_group
from .world import NON_GROUP_MEMBER, WORLD

__all__ = ["send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv", "monitored_barrier"]

# Tags below zero are reserved for torchdist's own traffic on the p2p channel.
_MONITORED_BARRIER_TAG = -1
_MONITORED_BARRIER_ACK_TAG = -2


def _peer(pg: ProcessGroup, op: str, rank: int | None, group_rank: int | None, role: str) -> int:
    if rank is None and group_rank is None:
        raise ValueError(f"{op}: {role} rank must be given (as {role}= or group_{role}=)")
    peer = group_root(pg, op, rank, group_rank)
    if peer == pg.rank():
        what = "destination" if role == "dst" else "source"
        # PyTorch checks this in Python for send only (ValueError); isend, recv and irecv
        # reach its backend, which refuses with a RuntimeError
        raise (ValueError if op == "send" else RuntimeError)(
            f"Invalid {what} rank: {what} rank should not be the same as the rank of the current process."
        )
    return peer


def isend(tensor: torch.Tensor, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0,
          group_dst: int | None = None) -> Work | None:
    """Start sending ``tensor`` to ``dst``; the Work completes once it is handed off."""
    return _post_send(tensor, dst, group, tag, group_dst, async_op=True)


def irecv(tensor: torch.Tensor, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0,
          group_src: int | None = None) -> Work | None:
    """Start receiving into ``tensor`` from ``src`` (None: from any rank)."""
    return _post_recv(tensor, src, group, tag, group_src, async_op=True)


def _post_send(tensor: torch.Tensor, dst: int | None, group, tag: int, group_dst: int | None,
               async_op: bool) -> Work | None:
    """``isend``; ``async_op=False``: the caller waits next (``send``) and drives it itself."""
    op = "isend" if async_op else "send"
    pg = member_group(group, op, refuse=not async_op)
    if pg is None:
        return None
    check_tensor(op, tensor)
    tag = check_tag("send", tag)  # named as PyTorch's errors name it: its ProcessGroup.send method
    peer = _peer(pg, op, dst, group_dst, "dst")
    return pg.backend.send(Staging().input(tensor), peer, tag, async_op=async_op)


def _post_recv(tensor: torch.Tensor, src: int | None, group, tag: int, group_src: int | None,
               async_op: bool) -> Work | None:
    """``irecv``; ``async_op=False``: the caller waits next (``recv``) and drives it itself."""
    op = "irecv" if async_op else "recv"
    pg = member_group(group, op)
    if pg is None:
        return None
    check_tensor(op, tensor)
    tag = check_tag("recv", tag)  # as PyTorch's ProcessGroup.recv names it
    peer = None if src is None and group_src is None else _peer(pg, op, src, group_src, "src")
    stage = Staging()
    return stage.finish(pg.backend.recv(stage.output(tensor), peer, tag, async_op=async_op), async_op=True)


def send(tensor: torch.Tensor, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0,
         group_dst: int | None = None) -> None:
    work = _post_send(tensor, dst, group, tag, group_dst, async_op=False)
    if work is not None:
        work.wait()


def recv(tensor: torch.Tensor, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0,
         group_src: int | None = None) -> int:
    """Receive into ``tensor``; returns the sender's global rank (-1 for a non-member)."""
    work = _post_recv(tensor, src, group, tag, group_src, async_op=False)
    if work is None:
        return -1
    work.wait()
    pg = WORLD.resolve(group)
    sender = work._sender_rank if work._sender_rank >= 0 else group_root(pg, "recv", src, group_src)
    return pg.global_ranks[sender]


class P2POp:
    """One send or receive for ``batch_isend_irecv``: ``P2POp(isend, tensor, peer)``."""

    def __init__(self, op: Callable, tensor: torch.Tensor, peer: int | None = None,
                 group: ProcessGroup | None = None, tag: int = 0,
                 group_peer: int | None = None) -> None:
        if op not in (isend, irecv):
            raise ValueError(
                "Invalid ``op``. Expected ``op`` to be of type ``torchdist.isend`` or ``torchdist.irecv``."
            )
        if peer is None and group_peer is None:
            raise ValueError("P2POp: peer or group_peer must be given")
        check_tensor("P2POp", tensor)  # at construction, as PyTorch: not when the batch runs
        self.op = op
        self.tensor = tensor
        self.tag = tag
        # As PyTorch's: the group resolved (None: the default group), the peer as both its
        # global rank and its group rank. A non-member keeps what it was given.
        pg = WORLD.resolve(group)
        if pg is NON_GROUP_MEMBER:
            self.group, self.peer, self.group_peer = group, peer, group_peer
        else:
            self.group = pg
            self.group_peer = group_root(pg, "P2POp", peer, group_peer)
            self.peer = pg.global_ranks[self.group_peer]

    def __repr__(self) -> str:
        return f"P2POp({self.op.__name__}, peer={self.peer}, group_peer={self.group_peer}, tag={self.tag})"


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Start every send and receive of the list; returns their Works in list order."""
    if not isinstance(p2p_op_list, list) or not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise ValueError(
            "Invalid ``p2p_op_list``. Each op is expected to to be of type ``torchdist.P2POp``."
        )
    if len({id(WORLD.resolve(p.group)) for p in p2p_op_list}) > 1:
        raise ValueError("All ops need to use the same group.")
    works = []
    for p in p2p_op_list:
        peer = None if p.group_peer is not None else p.peer  # one of the two, as resolved by P2POp
        if p.op is isend:
            work = isend(p.tensor, peer, p.group, p.tag, p.group_peer)
        else:
            work = irecv(p.tensor, peer, p.group, p.tag, p.group_peer)
        if work is not None:
            works.append(work)
    return works


def monitored_barrier(group: ProcessGroup | None = None, timeout: timedelta | None = None,
                      wait_all_ranks: bool = False) -> None:
    """A barrier that names the ranks that did not arrive.

    Every rank reports to group rank 0, which waits up to ``timeout`` (default: the
    group's) and then either releases everyone or raises naming the missing ranks
    (the first one, or all of them with ``wait_all_ranks``).
    """
    pg = member_group(group, "monitored_barrier")
    if pg is None:
        return
    if timeout is None:
        timeout = pg.timeout
    elif not isinstance(timeout, timedelta):
        warnings.warn(f"Please specify timeout arg as a timedelta. Converting current value of {timeout} assuming "
                      "it represents seconds", stacklevel=2)
        timeout = timedelta(seconds=timeout)
    seconds = timeout.total_seconds()
    backend = pg.backend
    token = torch.zeros(1, dtype=torch.uint8)
    # A barrier that gives up breaks the group (as gloo's, which closes its connections):
    # its receives stay posted, and would take the next barrier's messages.
    if pg.rank() != 0:
        backend.send(token, 0, _MONITORED_BARRIER_TAG).wait()
        try:
            backend.recv(torch.zeros(1, dtype=torch.uint8), 0, _MONITORED_BARRIER_ACK_TAG).wait(seconds)
        except DistBackendError as exc:
            error = DistBackendError(
                f"monitored_barrier: rank {pg.global_ranks[pg.rank()]} received errors while waiting for "
                f"send/recv from rank {pg.global_ranks[0]}: {exc}")
            backend.fail("monitored_barrier", error)
            raise error from exc
        return
    deadline = time.monotonic() + seconds
    pending = {peer: backend.recv(torch.zeros(1, dtype=torch.uint8), peer, _MONITORED_BARRIER_TAG)
               for peer in range(1, pg.size())}
    missing, causes = [], []
    for peer, work in pending.items():
        try:
            work.wait(max(deadline - time.monotonic(), 1e-3))
        except DistBackendError:
            missing.append(pg.global_ranks[peer])
            if work.exception() is not None:  # not only late: the receive failed (a dead rank)
                causes.append(work.exception())
            if not wait_all_ranks:
                break
    if missing:
        ms = int(seconds * 1000)
        # PyTorch's words, then why, where a receive failed rather than timed out
        why = f" ({causes[0]})" if causes else ""
        if wait_all_ranks:
            names = ", ".join(map(str, missing))
            error = DistBackendError(f"Ranks {names} failed to pass monitoredBarrier in {ms} ms{why}")
        else:
            error = DistBackendError(f"Rank {missing[0]} failed to pass monitoredBarrier in {ms} ms{why}")
        backend.fail("monitored_barrier", error)
        raise error
    for peer in range(1, pg.size()):
        backend.send(token, peer, _MONITORED_BARRIER_ACK_TAG).wait()
