"""The RPC backend registry: ``BackendType`` and the handlers each backend is made of (PyTorch's API).

A backend is a name and two handlers, a :class:`BackendValue`:

- ``construct_rpc_backend_options_handler(rpc_timeout, init_method, **kwargs)``
  gives the backend's options (``construct_rpc_backend_options``);
- ``init_backend_handler(store=, name=, rank=, world_size=, rpc_backend_options=)``
  starts the backend and returns its agent (``init_backend``).

``register_backend`` adds a member to ``BackendType``; ``init_rpc(backend=...)``
then constructs the default options through it, does the rendezvous, and calls
its init handler with the store (``world_size=None``: the dynamic group's
store). The built-in ``BackendType.TENSORPIPE`` starts torchdist's one agent
(:mod:`.agent`); torchdist has no other transport, so a registered backend
builds on it: its init handler calls ``init_backend(BackendType.TENSORPIPE,
...)`` (or TENSORPIPE's handler) and returns that agent or an object wrapping
it, which ``init_rpc`` then uses as the current agent. A handler that starts no
agent is an error.

One difference from PyTorch, deliberate: PyTorch replaces the ``BackendType``
class by a new one at each registration, so ``rpc.BackendType`` (imported
before) lacks the new member and its old members stop being ``BackendType``s;
here the one class gains the member in place.
"""

from __future__ import annotations

import collections
import enum
import logging
from typing import Any

from .._store.base import Store
from .constants import DEFAULT_INIT_METHOD, DEFAULT_NUM_WORKER_THREADS, DEFAULT_RPC_TIMEOUT_SEC
from .options import RpcBackendOptions, TensorPipeRpcBackendOptions

__all__ = ["backend_registered", "register_backend", "construct_rpc_backend_options", "init_backend",
           "BackendValue", "BackendType"]

logger = logging.getLogger(__name__)

BackendValue = collections.namedtuple("BackendValue",
                                      ["construct_rpc_backend_options_handler", "init_backend_handler"])

BackendType = enum.Enum(value="BackendType", names={})  # type: ignore[misc] - members are added by register_backend
BackendType.__repr__ = lambda self: "BackendType." + self.name  # type: ignore[method-assign]
BackendType.__doc__ = """An enum class of available backends.

    torchdist ships with a builtin ``BackendType.TENSORPIPE`` backend (its own TCP / shared-memory agent).
    Additional ones can be registered using :func:`register_backend`.
"""


def _add_member(cls: type[enum.Enum], name: str, value: Any) -> enum.Enum:
    """Give the enum ``cls`` a new member in place (the enum module's own bookkeeping, as its functional API
    fills it)."""
    member = object.__new__(cls)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = cls
    cls._member_names_.insert(0, name)  # the newest first, as PyTorch's rebuilt enum iterates
    cls._member_map_[name] = member
    cls._value2member_map_.setdefault(value, member)
    type.__setattr__(cls, name, member)  # (EnumType.__setattr__ refuses to touch members)
    return member


def backend_registered(backend_name: str) -> bool:
    """True if ``backend_name`` has been registered with ``register_backend``."""
    return backend_name in BackendType.__members__


def register_backend(backend_name: str, construct_rpc_backend_options_handler: Any,
                     init_backend_handler: Any) -> enum.Enum:
    """Register a new RPC backend; returns its member ``BackendType.<backend_name>``."""
    if backend_registered(backend_name):
        raise RuntimeError(f"RPC backend {backend_name}: already registered")
    return _add_member(BackendType, backend_name, BackendValue(
        construct_rpc_backend_options_handler=construct_rpc_backend_options_handler,
        init_backend_handler=init_backend_handler))


def construct_rpc_backend_options(backend: enum.Enum, rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
                                  init_method: str = DEFAULT_INIT_METHOD, **kwargs: Any) -> RpcBackendOptions:
    """The options of ``backend``, made by its handler."""
    return backend.value.construct_rpc_backend_options_handler(rpc_timeout, init_method, **kwargs)


def init_backend(backend: enum.Enum, *args: Any, **kwargs: Any) -> Any:
    """Start ``backend`` (its init handler); returns its agent."""
    return backend.value.init_backend_handler(*args, **kwargs)


def resolve_backend(backend: Any, rpc_backend_options: Any) -> tuple[enum.Enum, RpcBackendOptions]:
    """``init_rpc``'s checks (PyTorch's errors): the backend (given, inferred from the options' type, or
    TENSORPIPE) and its options (given, or the backend's defaults)."""
    if backend is not None and not isinstance(backend, BackendType):
        raise TypeError("Argument backend must be a member of BackendType")
    if rpc_backend_options is not None and not isinstance(rpc_backend_options, RpcBackendOptions):
        raise TypeError("Argument rpc_backend_options must be an instance of RpcBackendOptions")
    if backend is None and rpc_backend_options is not None:
        # PyTorch takes the first backend whose options type the options are an instance of (in practice
        # TENSORPIPE: its rpc.BackendType is the class from before any registration). Here a backend whose
        # options type is exactly theirs comes first, TENSORPIPE before the registered ones: registering a
        # backend never changes what plain TensorPipe options select, and one registered with a subclass of
        # them is selected by its own options
        order = [BackendType.TENSORPIPE] + [c for c in BackendType if c is not BackendType.TENSORPIPE]
        kinds = [(candidate, type(construct_rpc_backend_options(candidate))) for candidate in order]
        matches = [c for c, kind in kinds if type(rpc_backend_options) is kind] or \
            [c for c, kind in kinds if isinstance(rpc_backend_options, kind)]
        if not matches:
            raise TypeError(f"Could not infer backend for options {rpc_backend_options}")
        backend = matches[0]
        if backend != BackendType.TENSORPIPE:
            logger.warning(
                "RPC was initialized with no explicit backend but with options corresponding to %s, hence that "
                "backend will be used instead of the default BackendType.TENSORPIPE. To silence this warning pass "
                "`backend=%s` explicitly.", backend, backend)
    if backend is None:
        backend = BackendType.TENSORPIPE
    if rpc_backend_options is None:
        rpc_backend_options = construct_rpc_backend_options(backend)
    return backend, rpc_backend_options


# -- the built-in backend ------------------------------------------------------------------------------------


def _tensorpipe_construct_rpc_backend_options_handler(rpc_timeout: float, init_method: str,
                                                      num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS,
                                                      _transports: list | None = None, _channels: list | None = None,
                                                      **kwargs: Any) -> TensorPipeRpcBackendOptions:
    return TensorPipeRpcBackendOptions(rpc_timeout=rpc_timeout, init_method=init_method,
                                       num_worker_threads=num_worker_threads, _transports=_transports,
                                       _channels=_channels)


def _tensorpipe_init_backend_handler(store: Store, name: str, rank: int, world_size: int | None,
                                     rpc_backend_options: TensorPipeRpcBackendOptions) -> Any:
    """Start torchdist's agent on ``store`` (a static group of ``world_size`` workers, or with None a dynamic
    one's store) and return it."""
    from . import api  # api imports this module

    if not isinstance(store, Store):
        raise TypeError(f"`store` must be a c10d::Store. {store}")
    if not isinstance(rpc_backend_options, TensorPipeRpcBackendOptions):
        raise TypeError(f"`rpc_backend_options` must be a `TensorPipeRpcBackendOptions`. {rpc_backend_options}")
    return api._start_agent(store, name, rank, world_size, rpc_backend_options)


register_backend("TENSORPIPE", _tensorpipe_construct_rpc_backend_options_handler, _tensorpipe_init_backend_handler)
