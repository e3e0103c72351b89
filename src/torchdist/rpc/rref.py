"""``RRef``: a reference to a value that lives on one worker (its owner).

One class plays PyTorch's OwnerRRef and UserRRef: ``is_owner()`` tells which. An
owner RRef holds the :class:`~torchdist.rpc.rref_context.OwnerState` (the value's
Future); a user RRef holds a fork id and asks the owner for the value. How forks
are counted, and when the owner drops the value, is in
:mod:`torchdist.rpc.rref_context`. An RRef can only be pickled inside an RPC: the
reducer registered here creates the destination's fork while the message is
pickled, and ``_rebuild_rref`` turns it back into an RRef on arrival.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from . import api
from .functions import check_async_result, is_async
from .options import UNSET_RPC_TIMEOUT, WorkerInfo
from .rref_context import (GloballyUniqueId, OwnerState, _rref_add_fork, _rref_child_accept, current)
from .serialization import SendState, current_recv_state, register_reducer

__all__ = ["RRef"]


class RRef:
    """``RRef(value)`` makes a local (owner) RRef; ``rpc.remote`` returns user RRefs."""

    def __init__(self, value: Any = None, type_hint: type | None = None) -> None:
        ctx = current()
        state = OwnerState(ctx.new_id())
        state.future.set_result(value)
        self._init_owner(ctx.worker_id, state, type_hint or type(value))

    # -- construction (internal) ---------------------------------------------------------
    def _init_owner(self, owner: int, state: OwnerState, type_hint: type | None = None) -> None:
        self._owner_id = owner
        self._rref_id = state.rref_id
        self._fork_id: GloballyUniqueId | None = None
        self._state: OwnerState | None = state
        self._type = type_hint
        self._confirmed = True
        self._deleted = False
        self._error: BaseException | None = None

    @classmethod
    def _owner(cls, owner: int, state: OwnerState, type_hint: type | None = None) -> "RRef":
        rref = cls.__new__(cls)
        rref._init_owner(owner, state, type_hint)
        return rref

    @classmethod
    def _user(cls, owner: int, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId, confirmed: bool,
              type_hint: type | None = None) -> "RRef":
        ctx = current()
        rref = cls.__new__(cls)
        rref._owner_id, rref._rref_id, rref._fork_id = owner, rref_id, fork_id
        rref._state, rref._type, rref._confirmed, rref._deleted, rref._error = None, type_hint, confirmed, False, None
        rref._creation = None  # the remote() call that creates the value, for RRefs made by remote()
        if confirmed:
            ctx.confirm(owner, rref_id, fork_id)
        ctx.users.add(rref)
        rref._finalizer = weakref.finalize(rref, ctx.on_collected, owner, rref_id, fork_id)
        return rref

    def _set_confirmed(self, error: BaseException | None = None) -> None:
        self._error = error
        self._confirmed = True
        current().confirm(self._owner_id, self._rref_id, self._fork_id)

    def _discard(self) -> None:
        """A fork the owner never heard of (its remote() could not be sent): nothing to delete."""
        self._deleted = True
        self._finalizer.detach()
        current().users.discard(self)

    def _mark_deleted(self) -> None:
        """Shutdown: release this fork now; later use raises."""
        if self._fork_id is not None and not self._deleted:
            self._deleted = True
            if self._finalizer.detach() is not None:
                current().forget(self._owner_id, self._rref_id, self._fork_id)

    # -- the public API ------------------------------------------------------------------
    def is_owner(self) -> bool:
        return self._state is not None

    def owner(self) -> WorkerInfo:
        return api.get_worker_info(self._owner_id)

    def owner_name(self) -> str:
        return self.owner().name

    def confirmed_by_owner(self) -> bool:
        return self._confirmed

    def local_value(self) -> Any:
        """The value, on the owner only (waits until it is ready)."""
        if self._state is None:
            raise RuntimeError(f"For {self!r}, can't call localValue() on user {api.get_worker_info()}. "
                               f"Call it on owner {self.owner()}")
        return self._state.future.wait()

    def to_here(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """A copy of the value on this worker (the value itself on the owner); blocks."""
        if self._deleted:
            raise RuntimeError(f"{self!r} has been deleted. Cannot call to_here() on it after deletion.")
        if self._state is not None:
            return self._state.future.wait()
        if self._creation is not None and self._creation.done():
            self._raise_creation_error()
        if self._error is not None:
            raise self._error
        # The owner answers once the value exists (as PyTorch's: a creation still running,
        # even past its own timeout, is waited for, within this call's timeout).
        return api.rpc_sync(self._owner_id, _rref_fetch, args=(self,), timeout=timeout)

    def _raise_creation_error(self) -> None:
        """Raise the error of the finished remote() call that created the value, if any."""
        try:
            self._creation.wait()
        except RuntimeError as exc:
            if str(exc).startswith("RPCErr:1:"):  # the remote() call ran past its timeout
                raise RuntimeError("RRef creation via rpc.remote() timed out, and it is possible that the RRef on "
                                   "the owner node does not exist.") from exc
            raise

    def _get_future(self) -> torch.futures.Future:
        """The owner's value Future (owner), or a Future of ``to_here()`` (user)."""
        if self._state is not None:
            return self._state.future
        return api.rpc_async(self._owner_id, _rref_fetch, args=(self,))

    def _get_type(self, timeout: float = UNSET_RPC_TIMEOUT, blocking: bool = True) -> type:
        if self._type is None:
            if self._state is not None:
                self._type = type(self._state.future.wait())
            else:
                self._type = api.rpc_sync(self._owner_id, _rref_type, args=(self,), timeout=timeout)
        return self._type

    def rpc_sync(self, timeout: float = UNSET_RPC_TIMEOUT) -> "_Proxy":
        """``rref.rpc_sync().method(*args)`` runs ``method`` of the value on its owner."""
        return _Proxy(self, api.rpc_sync, timeout)

    def rpc_async(self, timeout: float = UNSET_RPC_TIMEOUT) -> "_Proxy":
        return _Proxy(self, api.rpc_async, timeout)

    def remote(self, timeout: float = UNSET_RPC_TIMEOUT) -> "_Proxy":
        return _Proxy(self, api.remote, timeout)

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Run backward from the value (a scalar tensor) on its owner.

        With a context id, a distributed backward pass in that context (read the
        gradients with ``torchdist.autograd.get_gradients``); with -1, local autograd,
        which only the owner may run.
        """
        if dist_autograd_ctx_id == -1 and not self.is_owner():
            raise RuntimeError(f"{self!r}: backward() without a distributed autograd context id runs local "
                               f"autograd and must be called on the owner {self.owner()}")
        api.rpc_sync(self._owner_id, _rref_backward, args=(self, dist_autograd_ctx_id, retain_graph))

    def __reduce__(self):
        raise RuntimeError("Can not pickle rref in python pickler, rref can only be pickled when using RPC")

    def __repr__(self) -> str:
        rid = f"GloballyUniqueId(created_on={self._rref_id[0]}, local_id={self._rref_id[1]})"
        if self._fork_id is None:
            return f"OwnerRRef({rid})"
        fid = f"GloballyUniqueId(created_on={self._fork_id[0]}, local_id={self._fork_id[1]})"
        return f"UserRRef(rref_id={rid}, fork_id={fid})"


class _Proxy:
    """``rref.rpc_sync()`` & co.: attribute access yields a function that calls the method remotely."""

    def __init__(self, rref: RRef, call, timeout: float) -> None:
        self._rref, self._call, self._timeout = rref, call, timeout

    def __getattr__(self, name: str):
        def method(*args, **kwargs):
            return self._call(self._rref._owner_id, _invoke_method, args=(self._rref, name, args, kwargs),
                              timeout=self._timeout)
        return method


# -- pickling inside RPC ---------------------------------------------------------------------
def _reduce_rref(state: SendState, rref: RRef) -> tuple:
    """Create the destination's fork (see the protocol in rref_context)."""
    if rref._deleted:
        raise RuntimeError(f"{rref!r} has been deleted and cannot be sent")
    ctx = current()
    fork_id = ctx.new_id()
    if rref._state is not None:  # the owner: the fork is counted before it leaves
        ctx.add_fork(rref._state, fork_id)
    else:  # a user: keep our fork alive until the receiver tells us the owner knows the child
        ctx.hold_child(fork_id, rref)
    return (_rebuild_rref, (rref._owner_id, rref._rref_id, fork_id, ctx.worker_id, rref._type))


def _rebuild_rref(owner: int, rref_id: GloballyUniqueId, fork_id: GloballyUniqueId, parent: int,
                  type_hint: type | None) -> RRef:
    ctx = current()
    recv = current_recv_state()
    if owner == ctx.worker_id:
        state = ctx.owner_state(rref_id)  # listed: a live fork covers it
        rref = RRef._owner(owner, state, type_hint)
        if fork_id in state.forks:  # our own fork came back: it covered the message only
            ctx.drop_fork(rref_id, fork_id)
        if parent != owner:
            ctx.send(parent, _rref_child_accept, (fork_id,))
        return rref
    if parent == owner:
        return RRef._user(owner, rref_id, fork_id, confirmed=True, type_hint=type_hint)
    rref = RRef._user(owner, rref_id, fork_id, confirmed=False, type_hint=type_hint)

    def register() -> None:  # after the whole message is loaded: sending may not nest in pickle.loads
        future = ctx.send(owner, _rref_add_fork, (rref_id, fork_id))

        def accepted(fut: torch.futures.Future) -> None:
            try:
                fut.wait()
                rref._set_confirmed()
            except Exception as exc:  # noqa: BLE001 - the owner is gone: to_here will say so
                rref._set_confirmed(exc)
            ctx.send(parent, _rref_child_accept, (fork_id,))
        future.add_done_callback(accepted)

    if recv is not None:
        recv.after_load.append(register)
    else:
        register()
    return rref


register_reducer(RRef, _reduce_rref)


# -- handlers run on the owner ---------------------------------------------------------------
def _rref_fetch(rref: RRef) -> torch.futures.Future:
    return rref._state.future


_rref_fetch._async_execution = True  # reply when the value is ready, without holding a thread


def _rref_type(rref: RRef) -> type:
    return type(rref._state.future.wait())


def _invoke_method(rref: RRef, name: str, args: tuple, kwargs: dict) -> torch.futures.Future:
    """The proxies' call of ``method``; always a Future, so that the reply (or a remote()'s
    value) is the value of an ``@async_execution`` method's Future and a plain method's result."""
    method = getattr(rref.local_value(), name)
    result = method(*args, **kwargs)
    if is_async(method):
        return check_async_result(method, result)
    done = torch.futures.Future()
    done.set_result(result)
    return done


_invoke_method._async_execution = True


def _rref_backward(rref: RRef, context_id: int, retain_graph: bool) -> None:
    value = rref.local_value()
    if context_id == -1:
        value.backward(retain_graph=retain_graph)
        return
    from .. import autograd as dist_autograd

    dist_autograd.backward(context_id, [value], retain_graph=retain_graph)
