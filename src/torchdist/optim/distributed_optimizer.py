"""``DistributedOptimizer``: one local optimizer per parameter owner, stepped with a context's gradients.

``DistributedOptimizer(optim.SGD, [param_rref, ...], lr=0.1)`` groups the RRefs by
owner and creates, on each owner, a :class:`_LocalOptimizer` over that owner's
parameters (constructor errors are raised here). ``step(context_id)`` asks every
owner, concurrently, to put the context's gradients (from
``torchdist.autograd.get_gradients``) in ``param.grad`` for the length of its
optimizer's ``step`` (the owner's own ``.grad`` is restored after); the first
remote error is raised after all have finished.

Several trainers may step the same parameters: a process-wide lock per owner
serializes the local steps, as in PyTorch.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

import torch

from .. import autograd as dist_autograd
from .. import rpc

__all__ = ["DistributedOptimizer"]


class _LocalOptimizer:
    """Lives on a parameters' owner; made through ``rpc.remote``."""

    _lock = threading.Lock()  # one step at a time per process, whatever the trainer

    def __init__(self, optimizer_class: type, params_rref: list[rpc.RRef], *args: Any, **kwargs: Any) -> None:
        self._params = [rref.local_value() for rref in params_rref]
        self.optim = optimizer_class(self._params, *args, **kwargs)

    def step(self, context_id: int) -> None:
        grads = dist_autograd.get_gradients(context_id)
        with _LocalOptimizer._lock:
            # The context's gradients stand in for .grad during the step only: as with
            # PyTorch's functional optimizers, the owner's own .grad is left as it was.
            own = [param.grad for param in self._params]
            try:
                for param in self._params:
                    param.grad = grads.get(param)
                self.optim.step()
            finally:
                for param, grad in zip(self._params, own):
                    param.grad = grad


def _check_created(optimizer_rref: rpc.RRef) -> None:
    optimizer_rref.local_value()  # raises the constructor's error, if any


def _local_step(optimizer_rref: rpc.RRef, context_id: int) -> None:
    optimizer_rref.local_value().step(context_id)


class DistributedOptimizer:
    """Update parameters on their owners with the gradients of a distributed autograd context."""

    def __init__(self, optimizer_class: type, params_rref: list[rpc.RRef], *args: Any, **kwargs: Any) -> None:
        by_owner: dict[int, list[rpc.RRef]] = defaultdict(list)
        for rref in params_rref:
            if not isinstance(rref, rpc.RRef):
                raise TypeError(f"DistributedOptimizer expects a list of RRefs to parameters, got "
                                f"{type(rref).__name__}")
            by_owner[rref.owner().id].append(rref)
        self.remote_optimizers = [
            rpc.remote(owner, _LocalOptimizer, args=(optimizer_class, rrefs, *args), kwargs=kwargs)
            for owner, rrefs in sorted(by_owner.items())
        ]
        _wait_all([rpc.rpc_async(opt.owner(), _check_created, args=(opt,)) for opt in self.remote_optimizers])

    def step(self, context_id: int) -> None:
        """One optimizer step on every owner, with the gradients of ``context_id``."""
        dist_autograd.get_gradients(context_id)  # "Could not find autograd context" raised here, as in PyTorch
        _wait_all([rpc.rpc_async(opt.owner(), _local_step, args=(opt, context_id))
                   for opt in self.remote_optimizers])


def _wait_all(futures: list[torch.futures.Future]) -> None:
    errors = []
    for future in futures:
        try:
            future.wait()
        except Exception as exc:  # noqa: BLE001 - raise the first after all have finished
            errors.append(exc)
    if errors:
        raise errors[0]
