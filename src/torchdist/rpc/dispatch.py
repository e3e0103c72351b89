"""What a message means: the codec (pickling plus autograd recording) and the request handler.

A request is a tuple ``(RequestKind, func, args, kwargs, extra)``:

- ``CALL``: run ``func(*args, **kwargs)`` and reply with its result (``rpc_sync``,
  ``rpc_async`` and every internal message: RRef forks, autograd, barriers);
- ``REMOTE``: the same, but the result becomes the value of the owner RRef
  ``extra = (rref_id, fork_id)`` created here; the reply is only an acknowledgement
  that the owner has recorded the caller's fork (see :mod:`.rref_context`). A
  remote() to the caller itself has no fork (``fork_id`` None): its owner RRef
  already exists, and the result (not a copy) becomes its value.

Functions marked ``@async_execution`` return a Future; the reply (or the RRef's
value) follows when it completes. Requests that carry a distributed autograd
context run with that context current on the serving thread, so the RPCs they
make record their sends in it too.
"""

from __future__ import annotations

import enum
from typing import Any, Callable

import torch

from ..autograd import engine as autograd_engine
from ..autograd.context import container as autograd_contexts
from . import rref_context
from .agent import Outgoing
from .functions import check_async_result, is_async
from .serialization import RecvState, dumps, loads
from .wire import Frame

__all__ = ["RequestKind", "RpcCodec", "handle_request"]


class RequestKind(enum.IntEnum):
    CALL = 1
    REMOTE = 2


class RpcCodec:
    """The agent's :class:`~torchdist.rpc.agent.Codec`."""

    def encode(self, obj: Any, dst: int, context_id: int) -> Outgoing:
        payload, state = dumps(obj, dst)
        send_id = -1
        if context_id != -1 and state.grad_tensors:
            send_id = autograd_engine.record_send(context_id, dst, state.grad_tensors)
        return Outgoing(payload, state.buffers, state.keep_alive, context_id, send_id)

    def decode(self, frame: Frame, src: int) -> Any:
        hook = None
        if frame.context_id != -1 and frame.send_id != -1:
            hook = autograd_engine.recv_hook(frame.context_id, src, frame.send_id)
        return loads(frame.payload, frame.buffers, RecvState(src, hook))


def _run(func: Callable, args: tuple, kwargs: dict) -> Any:
    if not callable(func):
        raise TypeError(f"RPC target must be callable, got {type(func).__name__}: {func!r}")
    result = func(*args, **kwargs)
    if is_async(func):
        check_async_result(func, result)
    return result


def _settle(target: torch.futures.Future, source: torch.futures.Future) -> None:
    try:
        target.set_result(source.wait())
    except Exception as exc:  # noqa: BLE001 - the value is the error
        target.set_exception(exc)


def handle_request(src: int, request: Any, frame: Frame) -> Any:
    """The agent's handler: runs on the callee's thread pool."""
    kind, func, args, kwargs, extra = request
    context = autograd_contexts.get_or_create(frame.context_id) if frame.context_id != -1 else None
    if context is not None:
        with context.lock:
            context.peers.add(src)
    previous = autograd_contexts.set_current(context)
    try:
        if kind == RequestKind.CALL:
            return _run(func, args, kwargs)
        rref_id, fork_id = extra
        ctx = rref_context.current()
        if fork_id is None:  # from this worker; a call that timed out meanwhile still runs
            state = ctx.take_local_creation(rref_id) or rref_context.OwnerState(rref_id)
        else:
            state = ctx.owner_state(rref_id)
            ctx.add_fork(state, fork_id)
        try:
            result = _run(func, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - the RRef's value is the error (to_here raises it)
            state.future.set_exception(exc)
            return None
        if isinstance(result, torch._C.Future) and is_async(func):
            result.add_done_callback(lambda fut: _settle(state.future, fut))
        else:
            state.future.set_result(result)
        return None
    finally:
        autograd_contexts.set_current(previous)
