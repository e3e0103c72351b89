"""``ProcessGroupBackend``: the operations a communication backend implements.

The API layer (``torchdist._c10d``) validates arguments, maps global ranks to group
ranks, and stages non-contiguous tensors, then calls one of these methods. So a
backend sees only:

- *group ranks* (0 .. size-1) for every root, source and destination;
- contiguous CPU tensors of the dtypes and shapes the API checked agree locally;
- calls in the same order on every rank of the group (the c10d contract); the
  backend numbers them (the group's *sequence number*) to detect ranks that
  disagree.

Every method returns a :class:`~torchdist._process_group.work.Work`. A synchronous
caller simply waits on it. A collective called with ``async_op=True`` (PyTorch's
``opts.asyncOp``) must make progress without the caller waiting on it, as gloo's
worker threads make it: a peer may need it done before it joins what this caller
does next. Without it the backend may run the op when the caller waits, on the
caller's thread. Point-to-point ops are always posted at once, whatever is queued
before them; ``async_op=False`` there means the caller waits next (``send``,
``recv``) and drives the transfer itself. Methods a backend does not override raise a ``RuntimeError`` naming
the backend and the op.
"""

from __future__ import annotations

from datetime import timedelta

import torch

from ..errors import DistBackendError
from .reduce_op import ReduceOp
from .work import Work

__all__ = ["ProcessGroupBackend"]


class ProcessGroupBackend:
    """Base of every backend: one instance serves one process group on one rank."""

    #: The name under which the backend is registered ("tcp", "shm", ...).
    name = "undefined"
    #: Whether an ``async_op=True`` collective runs beside the caller's compute rather
    #: than taking turns with it on the caller's core; DDP issues its buckets
    #: asynchronously only where it does (see ``_ddp/reducer.py``).
    async_overlaps_compute = False

    def __init__(
        self,
        store,
        rank: int,
        size: int,
        timeout: timedelta,
        group_name: str = "",
        global_ranks: list[int] | None = None,
    ) -> None:
        """``store`` is already prefixed for this group: its keys are private to it.

        ``group_name`` and ``global_ranks`` (group rank -> global rank) exist for error
        messages, which name ranks as users know them.
        """
        self.store = store
        self._rank = rank
        self._size = size
        self.timeout = timeout
        self.group_name = group_name
        self.global_ranks = list(global_ranks) if global_ranks is not None else list(range(size))
        #: The group's collective sequence number: the backend adds 1 per collective it starts.
        self.seq = 0

    @property
    def timeout(self) -> timedelta:
        """The group's timeout: what an op waits for its peers unless it has its own."""
        return self._timeout

    @timeout.setter
    def timeout(self, value: timedelta) -> None:  # ProcessGroup.set_timeout: later ops use it
        self._timeout = value
        self._seconds = value.total_seconds()

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def _unsupported(self, op: str) -> RuntimeError:
        return RuntimeError(f"backend {self.name!r} does not implement {op}")

    # -- collectives -----------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, root: int, *, async_op: bool = False) -> Work:
        raise self._unsupported("broadcast")

    def allreduce(self, tensors: list[torch.Tensor], op: ReduceOp, *, async_op: bool = False) -> Work:
        """Reduce each tensor of the list across ranks, in place (one call = coalesced)."""
        raise self._unsupported("allreduce")

    def reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp, *, async_op: bool = False) -> Work:
        raise self._unsupported("reduce")

    def allgather(self, outputs: list[torch.Tensor], input: torch.Tensor, *, async_op: bool = False) -> Work:
        """outputs[i] receives rank i's input; outputs may differ in size per rank."""
        raise self._unsupported("allgather")

    def allgather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Work:
        """output is size x input, concatenated in rank order."""
        raise self._unsupported("allgather_into_tensor")

    def gather(self, outputs: list[torch.Tensor] | None, input: torch.Tensor, root: int, *,
               async_op: bool = False) -> Work:
        raise self._unsupported("gather")

    def scatter(self, output: torch.Tensor, inputs: list[torch.Tensor] | None, root: int, *,
                async_op: bool = False) -> Work:
        raise self._unsupported("scatter")

    def reduce_scatter(self, output: torch.Tensor, inputs: list[torch.Tensor], op: ReduceOp, *,
                       async_op: bool = False) -> Work:
        """output receives the reduction over ranks of inputs[rank]; sizes may differ."""
        raise self._unsupported("reduce_scatter")

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, *,
                              async_op: bool = False) -> Work:
        raise self._unsupported("reduce_scatter_tensor")

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], *, async_op: bool = False) -> Work:
        """outputs[j] receives rank j's inputs[rank]."""
        raise self._unsupported("alltoall")

    def barrier(self, *, async_op: bool = False, timeout: timedelta | None = None) -> Work:
        """``timeout``: the op's own (PyTorch's ``BarrierOptions.timeout``); None: the group's."""
        raise self._unsupported("barrier")

    # -- point to point ----------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, async_op: bool = False) -> Work:
        raise self._unsupported("send")

    def recv(self, tensor: torch.Tensor, src: int | None, tag: int, *, async_op: bool = False) -> Work:
        """``src=None`` receives from any rank; the Work's source_rank() tells which."""
        raise self._unsupported("recv")

    # -- lifecycle ---------------------------------------------------------------------
    def shutdown(self) -> None:
        """Release sockets and threads; later calls raise."""

    def abort(self) -> None:
        """Tear down at once, failing whatever is in flight."""
        self.shutdown()

    def fail(self, op_name: str, error: DistBackendError) -> None:
        """Break the group with ``error``, which ``op_name`` found above the backend (a
        monitored barrier that gave up): what is in flight fails, the peers are told, and
        later calls raise. Without a way to tell the peers, a backend aborts."""
        self.abort()

    def quiesce(self) -> None:
        """At interpreter exit: let queued and running ops finish and stop background
        threads (one still inside a torch op while the interpreter finalizes aborts the
        process). Nothing else is released: the process is about to end."""
