"""Distributed autograd contexts: what one worker knows about one backward-able forward pass.

A context is created by ``with torchdist.autograd.context() as context_id`` on the
worker that drives the pass, and lazily on every worker an RPC of that context
reaches (the context id travels in the frame header). Ids are unique in the job:
``(worker id << 48) + counter``, as in PyTorch.

Per context and worker:

- ``sends``: send points, ``send_id -> (destination, [tensors])``: tensors that
  required grad and left this worker in an RPC; their gradients come back later;
- ``grads``: accumulated gradients of this worker's leaves (parameters), keyed by
  the leaf tensor; ``torch.Tensor.grad`` is never touched;
- ``peers``: workers this context exchanged messages with, told to release it
  when the driver's ``with`` block ends;
- ``walked``: per running backward pass (``backward id``), the graph nodes with
  saved tensors that its local passes here went through, and the send points they
  started from; when a pass with ``retain_graph=False`` finishes, those nodes are
  marked freed and those send points dropped (see :mod:`.engine`).

The current context is per thread; nesting in one thread raises, as in PyTorch.
"""

from __future__ import annotations

import itertools
import threading
from typing import Iterator

import torch

__all__ = ["DistAutogradContext", "container"]


class DistAutogradContext:
    def __init__(self, context_id: int) -> None:
        self.context_id = context_id
        self.lock = threading.Lock()
        self.grads: dict[torch.Tensor, torch.Tensor] = {}
        self.sends: dict[int, tuple[int, list[torch.Tensor] | None]] = {}  # None: freed
        self.peers: set[int] = set()
        self.walked: dict[int, tuple[dict[int, object], set[int]]] = {}  # backward id -> (nodes, send ids)
        self.finished: set[int] = set()  # backward ids finished here (finishing is propagated once)
        self.current_pass = None  # the latest local pass (engine._Pass), for nodes run off its thread
        self._send_ids = itertools.count()

    def record_send(self, dst: int, tensors: list[torch.Tensor]) -> int:
        with self.lock:
            send_id = next(self._send_ids)
            self.sends[send_id] = (dst, tensors)
            self.peers.add(dst)
            return send_id

    def record_walk(self, backward_id: int, nodes: dict[int, object], send_id: int | None) -> None:
        """Remember the saved-tensor nodes (and the send point) one local pass of a backward went through."""
        with self.lock:
            walked_nodes, send_ids = self.walked.setdefault(backward_id, ({}, set()))
            walked_nodes.update(nodes)
            if send_id is not None and nodes:
                send_ids.add(send_id)

    def finish_walk(self, backward_id: int) -> tuple[dict[int, object], set[int]] | None:
        """What backward ``backward_id`` walked here; None if it was finished here already."""
        with self.lock:
            if backward_id in self.finished:
                return None
            self.finished.add(backward_id)
            return self.walked.pop(backward_id, ({}, set()))

    def accumulate(self, leaf: torch.Tensor, grad: torch.Tensor) -> None:
        with self.lock:
            old = self.grads.get(leaf)
            self.grads[leaf] = grad.detach().clone() if old is None else old + grad.detach()

    def gradient(self, leaf: torch.Tensor) -> torch.Tensor | None:
        """``leaf``'s gradient in this context so far (what ``get_gradients`` reports)."""
        with self.lock:
            return self.grads.get(leaf)

    def set_gradient(self, leaf: torch.Tensor, grad: torch.Tensor) -> None:
        """Replace ``leaf``'s gradient (DDP writes the averaged one back here)."""
        with self.lock:
            self.grads[leaf] = grad

    def __repr__(self) -> str:
        return f"DistAutogradContext(id={self.context_id}, sends={len(self.sends)}, grads={len(self.grads)})"


class _Container:
    """All contexts of this worker, and each thread's current one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._contexts: dict[int, DistAutogradContext] = {}
        self._local = threading.local()
        self.worker_id = 0
        self._counter = itertools.count()

    def set_worker_id(self, worker_id: int) -> None:
        self.worker_id = worker_id

    def new_context(self) -> DistAutogradContext:
        if getattr(self._local, "current", None) is not None:
            raise RuntimeError("Already have an autograd context id for this thread.")
        context_id = (self.worker_id << 48) + next(self._counter)
        context = DistAutogradContext(context_id)
        with self._lock:
            self._contexts[context_id] = context
        self._local.current = context
        return context

    def get_or_create(self, context_id: int) -> DistAutogradContext:
        with self._lock:
            context = self._contexts.get(context_id)
            if context is None:
                context = self._contexts[context_id] = DistAutogradContext(context_id)
            return context

    def retrieve(self, context_id: int) -> DistAutogradContext:
        with self._lock:
            context = self._contexts.get(context_id)
        if context is None:
            raise RuntimeError(f"Could not find autograd context with id: {context_id}")
        return context

    def release(self, context_id: int) -> DistAutogradContext | None:
        with self._lock:
            context = self._contexts.pop(context_id, None)
        if getattr(self._local, "current", None) is context and context is not None:
            self._local.current = None
        return context

    def current(self) -> DistAutogradContext | None:
        return getattr(self._local, "current", None)

    def set_current(self, context: DistAutogradContext | None) -> DistAutogradContext | None:
        previous = getattr(self._local, "current", None)
        self._local.current = context
        return previous

    def clear(self) -> None:
        with self._lock:
            self._contexts.clear()

    def __iter__(self) -> Iterator[DistAutogradContext]:
        with self._lock:
            return iter(list(self._contexts.values()))


#: The one container of this process.
container = _Container()
