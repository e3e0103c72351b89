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
worker's graph may be walked more than once in one backward, so each local pass
retains it (``torch.autograd.grad(..., retain_graph=True)``).

``retain_graph=False`` (the default) is applied when the whole backward is done::

    driver: passes done ─► finish(backward id) here, then on every peer of the
            context, which forwards it to its peers (each worker acts once per id)
    finish: every node with saved tensors that a pass of this backward walked here
            is marked freed (``node.metadata``); every send point whose pass walked
            such nodes is dropped, so the context no longer keeps that graph alive

A later pass that walks a marked node, or reaches a dropped send point, raises
PyTorch's ``Trying to backward through the graph a second time ...`` on that
worker. Nodes without saved tensors (a received tensor's node, a sum, a leaf) stay
walkable, as in PyTorch, whose engine frees only saved tensors. Python has no call
that frees a node's saved tensors without running it, so what the user's own
tensors keep alive (the driver's loss and its graph) is freed when they go, not at
the end of the backward.

Errors follow PyTorch: a failed pass on worker ``n`` raises ``RuntimeError("Error on
Node n: ...")`` and its callers prefix their own ids, so the driver sees
``Error on Node 0: Error on Node 1: <cause>``. Remote passes return their error
message rather than raising it, so the RPC layer adds no text of its own.
"""

from __future__ import annotations

import itertools
import threading
import traceback
from collections import OrderedDict
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .context import DistAutogradContext, container

__all__ = ["FREED_GRAPH_MESSAGE", "backward", "record_send", "recv_hook", "backward_from_send", "finish_backward",
           "release_remote", "register_post_accumulate_hook", "accumulating_context"]

#: PyTorch's message for a backward through a graph whose saved tensors were freed.
FREED_GRAPH_MESSAGE = (
    "Trying to backward through the graph a second time (or directly access saved tensors after they have "
    "already been freed). Saved intermediate values of the graph are freed when you call .backward() or "
    "autograd.grad(). Specify retain_graph=True if you need to backward through the graph a second time or if "
    "you need to access saved tensors after calling backward.")
_FREED_KEY = "torchdist.autograd.freed"  # in node.metadata: a backward with retain_graph=False walked it
_SAVED_PREFIX = "_raw_saved_"  # attributes of built-in nodes that hold saved tensors
# leaf -> {handle id: hook}. Not an attribute of the leaf: that would be pickled with it.
_post_accumulate_hooks: WeakIdKeyDictionary = WeakIdKeyDictionary()
_saves_by_type: dict[type, bool] = {}
_backward_ids = itertools.count(1)

_pass_local = threading.local()


class _Pass:
    """The backward pass a thread is running: what a ``_RecvBackward`` reached in it needs."""

    __slots__ = ("backward_id", "retain_graph", "futures")

    def __init__(self, backward_id: int, retain_graph: bool) -> None:
        self.backward_id = backward_id
        self.retain_graph = retain_graph
        self.futures: list = []


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

    current = getattr(_pass_local, "current", None)
    if current is None:  # not on the thread that runs the pass (a device thread): the context knows it
        current = container.retrieve(context_id).current_pass
    if current is None:  # a local .backward() reached the result of an RPC
        raise RuntimeError(
            "A plain .backward() reached a tensor received over RPC inside a distributed autograd context; "
            "its gradient must go back to the sender: use torchdist.autograd.backward(context_id, roots).")
    args = (context_id, send_id, index, grad.detach(), current.backward_id, current.retain_graph)
    current.futures.append(rpc_api.rpc_async(src, backward_from_send, args=args))


def _saves_tensors(node: Any) -> bool:
    """Whether ``node`` holds saved tensors (those are what a backward without retain_graph frees)."""
    if isinstance(node, torch.autograd.function.BackwardCFunction):  # a custom Function: its ctx
        return bool(node.saved_tensors)  # raises PyTorch's own error if a local backward freed them
    saves = _saves_by_type.get(type(node))
    if saves is None:
        saves = _saves_by_type[type(node)] = any(name.startswith(_SAVED_PREFIX) for name in dir(node))
    return saves


def _walk(roots: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict[int, Any]]:
    """The leaves reachable from ``roots`` and the nodes with saved tensors on the way.

    Raises PyTorch's error if one of those nodes was freed by an earlier backward.
    """
    leaves: dict[int, torch.Tensor] = {}
    saving: dict[int, Any] = {}
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
        if _saves_tensors(node):
            if node.metadata.get(_FREED_KEY):
                raise RuntimeError(FREED_GRAPH_MESSAGE)
            saving[id(node)] = node
        variable = getattr(node, "variable", None)
        if variable is not None:  # AccumulateGrad: a leaf
            leaves[id(variable)] = variable
            continue
        for child, _ in node.next_functions:
            if child is not None:
                stack.append(child)
    return list(leaves.values()), saving


def register_post_accumulate_hook(leaf: torch.Tensor, hook) -> torch.utils.hooks.RemovableHandle:
    """Call ``hook(leaf)`` each time a distributed backward has added a gradient of ``leaf``
    to its context, with :func:`accumulating_context` naming that context meanwhile.

    ``Tensor.register_post_accumulate_grad_hook`` for the gradients a distributed backward
    keeps in its context (it never touches ``.grad``): the hook PyTorch's DDP reducer puts
    on every parameter's AccumulateGrad node, which PyTorch's distributed engine runs, so
    that DDP averages a model's gradients in the context too."""
    hooks = _post_accumulate_hooks.get(leaf)
    if hooks is None:
        hooks = _post_accumulate_hooks[leaf] = OrderedDict()  # RemovableHandle references it weakly
    handle = torch.utils.hooks.RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


def accumulating_context() -> DistAutogradContext | None:
    """The context whose backward is running a post-accumulate hook on this thread, else None."""
    return getattr(_pass_local, "accumulating", None)


def _capture(context: DistAutogradContext, leaf: torch.Tensor, hooks: dict):
    """A tensor hook on ``leaf`` for one local pass: add the gradient to the context, then
    run ``leaf``'s post-accumulate hooks while the pass is still running (so that they
    may queue callbacks on the autograd engine, as DDP's reducer does)."""
    def capture(grad: torch.Tensor) -> torch.Tensor:
        context.accumulate(leaf, grad)
        previous = accumulating_context()
        _pass_local.accumulating = context
        try:
            for hook in list(hooks.values()):
                hook(leaf)
        finally:
            _pass_local.accumulating = previous
        return grad
    return capture


class _PassError(Exception):
    """A local pass failed; ``message`` starts with ``Error on Node <this worker>: ``."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _local_pass(context: DistAutogradContext, roots: list[torch.Tensor], grads: list[torch.Tensor],
                current: _Pass, send_id: int | None = None) -> None:
    """One local backward from ``roots``; raises :class:`_PassError` (labelled with this worker) on failure."""
    label = f"Error on Node {container.worker_id}: "
    try:
        leaves, saving = _walk(roots)
        if not current.retain_graph:
            context.record_walk(current.backward_id, saving, send_id)
        previous = getattr(_pass_local, "current", None)
        _pass_local.current = current
        context.current_pass = current
        # Leaves with post-accumulate hooks (DDP's parameters) get their gradient in the
        # context, and their hooks run, as it arrives; the others' once the pass is done.
        hooked = [(leaf, _post_accumulate_hooks.get(leaf)) for leaf in leaves]
        captures = [leaf.register_hook(_capture(context, leaf, hooks)) for leaf, hooks in hooked if hooks]
        try:
            results = (torch.autograd.grad(roots, leaves, grads, retain_graph=True, allow_unused=True)
                       if leaves else ())
        finally:
            _pass_local.current = previous
            for handle in captures:
                handle.remove()
    except Exception as exc:  # noqa: BLE001 - a user's backward may raise anything; PyTorch reports it so
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        raise _PassError(f"{label}{exc}\n{text}") from exc
    for (leaf, hooks), grad in zip(hooked, results):
        if grad is not None and leaf.grad_fn is None and not _is_anchor(leaf) and not hooks:
            context.accumulate(leaf, grad)
    errors = []
    for future in current.futures:  # the passes this one started on other workers
        try:
            error = future.wait()
        except Exception as exc:  # noqa: BLE001 - the RPC itself failed (the peer died)
            error = str(exc)
        if error is not None:
            errors.append(error)
    current.futures.clear()
    if errors:  # the first, after all have finished
        raise _PassError(label + errors[0])


def _is_anchor(leaf: torch.Tensor) -> bool:
    return getattr(leaf, "_td_anchor", False)


def backward(context_id: int, roots: list[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the distributed backward pass from scalar ``roots`` in context ``context_id``."""
    context = container.retrieve(context_id)
    roots = list(roots)
    if not roots:
        raise RuntimeError("No tensors provided for gradient computation.")
    for root in roots:
        if not isinstance(root, torch.Tensor):
            raise TypeError(f"backward: roots must be tensors, got {type(root).__name__}")
        if not root.requires_grad:
            raise RuntimeError("requires_grad not set on root")
        if root.numel() != 1:
            raise RuntimeError(f"{tuple(root.shape)} is not a scalar, all roots need to be scalar")
    current = _Pass((container.worker_id << 48) + next(_backward_ids), retain_graph)
    try:
        _local_pass(context, roots, [torch.ones_like(root) for root in roots], current)
    except _PassError as exc:
        error: RuntimeError | None = RuntimeError(exc.message)
    else:
        error = None
    if not retain_graph:
        finish_backward(context_id, current.backward_id, container.worker_id, error is None)
    if error is not None:
        raise error


def backward_from_send(context_id: int, send_id: int, index: int, grad: torch.Tensor, backward_id: int,
                       retain_graph: bool) -> str | None:
    """Run on a sender: continue the pass from the tensor of a send point (an RPC handler).

    Returns None, or the error message (``Error on Node <this worker>: ...``): the
    caller prefixes its own id, as PyTorch's engine does.
    """
    try:
        context = container.retrieve(context_id)
        with context.lock:
            _, tensors = context.sends[send_id]
        if tensors is None:  # dropped by an earlier backward without retain_graph
            return f"Error on Node {container.worker_id}: {FREED_GRAPH_MESSAGE}"
        _local_pass(context, [tensors[index]], [grad], _Pass(backward_id, retain_graph), send_id)
    except _PassError as exc:
        return exc.message
    except RuntimeError as exc:  # the context is gone
        return f"Error on Node {container.worker_id}: {exc}"
    return None


def finish_backward(context_id: int, backward_id: int, origin: int, succeeded: bool) -> None:
    """End backward ``backward_id`` here and on the context's other peers (an RPC handler too).

    After a successful backward without ``retain_graph`` the nodes with saved tensors
    it walked here are marked freed and the send points it started from are dropped;
    after a failed one they stay usable. Each worker acts once per backward id, so
    the forwarding stops in cycles of peers.
    """
    from ..rpc import api as rpc_api  # at call time: rpc imports this package

    try:
        context = container.retrieve(context_id)
    except RuntimeError:
        return  # released meanwhile: nothing left to free
    walked = context.finish_walk(backward_id)
    if walked is None:
        return
    nodes, send_ids = walked
    if succeeded:
        for node in nodes.values():
            node.metadata[_FREED_KEY] = True
        with context.lock:
            for send_id in send_ids:
                dst, _ = context.sends[send_id]
                context.sends[send_id] = (dst, None)
    if not rpc_api.is_initialized():
        return
    me = container.worker_id
    with context.lock:
        peers = sorted(context.peers - {origin, me})
    futures = []
    for peer in peers:
        try:
            futures.append(rpc_api.rpc_async(peer, finish_backward, args=(context_id, backward_id, me, succeeded)))
        except RuntimeError:  # the peer left: so did its share of the graph
            continue
    for future in futures:
        try:
            future.wait()
        except RuntimeError:
            continue


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
