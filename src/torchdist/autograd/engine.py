"""The distributed backward pass: local autograd passes chained by RPCs.

Recording (during the forward, inside a context):

- *send*: when an RPC of a context carries tensors that require grad, the sender
  records them as a send point (``context.record_send``) and puts the context id
  and send id in the frame header;
- *recv*: the receiver rebuilds each such tensor through :class:`_RecvBackward`,
  an autograd Function whose backward ships the tensor's gradient back to the
  sender's send point. Its input is a per-message *anchor* leaf, so the node is
  part of the graph (and is executed) even though the received tensor has no
  history here.

Backward (``backward(context_id, roots)`` on the driver)::

    local pass(roots, grads):
        inputs  = every leaf reachable from roots (AccumulateGrad nodes; anchors too)
        torch.autograd.grad(roots, inputs, grads, retain_graph=True)
            └─ each _RecvBackward reached: rpc_async(sender, backward_from_send,
                                                     (context, send id, index, grad))
        add the leaves' gradients to the context (never to .grad)
        wait for those RPCs: each runs a local pass on the sender, from its send
        point, which may in turn send further

Every partial gradient that reaches a send point triggers its own pass; since
backward is linear, the contributions add up to what one local backward over the
whole graph gives (the reference the tests compare against). The price is that a
worker's graph may be walked more than once, so it is always retained until the
context is released; ``retain_graph`` is accepted for compatibility.

An error in a remote pass comes back as ``Error on Node <worker id>: ...``.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .context import DistAutogradContext, container

__all__ = ["backward", "record_send", "recv_hook", "backward_from_send", "release_remote"]

_pass_local = threading.local()


class _RecvBackward(torch.autograd.Function):
    """Identity in the forward; in the backward, sends the gradient to the sender's send point."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, tensor: torch.Tensor, info: tuple) -> torch.Tensor:
        ctx.info = info  # (src worker, context id, send id, index)
        ctx.mark_dirty(tensor)  # hand back the received tensor itself, not a view: in-place ops stay legal
        return tensor

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        src, context_id, send_id, index = ctx.info
        _propagate(src, context_id, send_id, index, grad)
        return None, None, None


def record_send(context_id: int, dst: int, tensors: list[torch.Tensor]) -> int:
    """Remember tensors sent to ``dst`` in a context; returns the send id for the header."""
    return container.get_or_create(context_id).record_send(dst, tensors)


def recv_hook(context_id: int, src: int, send_id: int):
    """The rebuild hook for one received message: wraps each grad-requiring tensor."""
    context = container.get_or_create(context_id)
    with context.lock:
        context.peers.add(src)
    anchor = torch.zeros((), requires_grad=True)
    anchor._td_anchor = True  # excluded from the context's gradients
    counter = iter(range(1 << 62))

    def wrap(tensor: torch.Tensor) -> torch.Tensor:
        return _RecvBackward.apply(anchor, tensor, (src, context_id, send_id, next(counter)))

    return wrap


def _propagate(src: int, context_id: int, send_id: int, index: int, grad: torch.Tensor) -> None:
    from ..rpc import api as rpc_api  # at call time: rpc imports this package

    pending = getattr(_pass_local, "futures", None)
    args = (context_id, send_id, index, grad.detach())
    if pending is None:  # not on the thread that runs the pass: send and wait here
        rpc_api.rpc_sync(src, backward_from_send, args=args)
    else:
        pending.append(rpc_api.rpc_async(src, backward_from_send, args=args))


def _reachable_leaves(roots: list[torch.Tensor]) -> list[torch.Tensor]:
    leaves: dict[int, torch.Tensor] = {}
    seen: dict[int, Any] = {}  # id -> node, holding the node so ids stay unique
    stack = []
    for root in roots:
        if root.grad_fn is None:
            leaves[id(root)] = root
        else:
            stack.append(root.grad_fn)
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)
        if variable is not None:  # AccumulateGrad: a leaf
            leaves[id(variable)] = variable
            continue
        for child, _ in node.next_functions:
            if child is not None:
                stack.append(child)
    return list(leaves.values())


def _local_pass(context: DistAutogradContext, roots: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    leaves = _reachable_leaves(roots)
    previous = getattr(_pass_local, "futures", None)
    _pass_local.futures = futures = []
    try:
        results = torch.autograd.grad(roots, leaves, grads, retain_graph=True, allow_unused=True) if leaves else ()
    finally:
        _pass_local.futures = previous
    for leaf, grad in zip(leaves, results):
        if grad is not None and leaf.grad_fn is None and not _is_anchor(leaf):
            context.accumulate(leaf, grad)
    errors = []
    for future in futures:
        try:
            future.wait()
        except Exception as exc:  # noqa: BLE001 - report the first, after all have finished
            errors.append(exc)
    if errors:
        raise errors[0]


def _is_anchor(leaf: torch.Tensor) -> bool:
    return getattr(leaf, "_td_anchor", False)


def backward(context_id: int, roots: list[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the distributed backward pass from scalar ``roots`` in context ``context_id``."""
    context = container.retrieve(context_id)
    roots = list(roots)
    for root in roots:
        if not isinstance(root, torch.Tensor):
            raise TypeError(f"backward: roots must be tensors, got {type(root).__name__}")
        if not root.requires_grad:
            raise RuntimeError("requires_grad not set on root")
        if root.numel() != 1:
            raise RuntimeError(f"{tuple(root.shape)} is not a scalar, all roots need to be scalar")
    _local_pass(context, roots, [torch.ones_like(root) for root in roots])


def backward_from_send(context_id: int, send_id: int, index: int, grad: torch.Tensor) -> None:
    """Run on a sender: continue the pass from the tensor of a send point (an RPC handler)."""
    from ..rpc import api as rpc_api

    try:
        context = container.retrieve(context_id)
        with context.lock:
            _, tensors = context.sends[send_id]
        _local_pass(context, [tensors[index]], [grad])
    except Exception as exc:
        if "Error on Node" in str(exc):  # already labelled by the worker where it happened
            raise
        raise RuntimeError(f"Error on Node {rpc_api.get_worker_info().id}: {exc}") from exc


def release_context(context_id: int, origin: int) -> None:
    """RPC handler: drop a context and tell its other peers (the context's end)."""
    context = container.release(context_id)
    if context is not None:
        release_remote(context, exclude=origin)


def release_remote(context: DistAutogradContext, exclude: int = -1) -> None:
    from ..rpc import api as rpc_api

    if not rpc_api.is_initialized():
        return
    me = rpc_api.get_worker_info().id
    for peer in sorted(context.peers - {exclude, me}):
        try:
            rpc_api.rpc_async(peer, release_context, args=(context.context_id, me))
        except Exception:  # noqa: BLE001 - the peer is gone; so is its context
            pass
