"""The user-facing calls of distributed autograd: ``context``, ``backward``, ``get_gradients``."""

from __future__ import annotations

import torch

from . import engine
from .context import container

__all__ = ["context", "backward", "get_gradients"]


class context:  # noqa: N801 - PyTorch's name
    """``with context() as context_id:`` scopes a distributed forward and backward pass.

    On exit the context is released here and on every worker it reached.
    """

    def __enter__(self) -> int:
        self._context = container.new_context()
        return self._context.context_id

    def __exit__(self, *exc_info: object) -> None:
        released = container.release(self._context.context_id)
        if released is not None:
            engine.release_remote(released)


def backward(context_id: int, roots: list[torch.Tensor], retain_graph: bool = False) -> None:
    """Distributed backward from scalar ``roots``; gradients go to the context, not ``.grad``."""
    engine.backward(context_id, roots, retain_graph)


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """This worker's accumulated gradients in the context, keyed by leaf tensor."""
    ctx = container.retrieve(context_id)
    with ctx.lock:
        return dict(ctx.grads)
