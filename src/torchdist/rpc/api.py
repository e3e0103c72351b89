"""The RPC entry points: ``init_rpc``, ``shutdown``, ``rpc_sync``/``rpc_async``/``remote``, worker infos.

One :class:`_Runtime` per process holds everything ``init_rpc`` built (agent, RRef
context, the default timeout; the agent knows the group's workers); ``shutdown``
tears it down, after which ``init_rpc`` may be called again.

Two kinds of group, one agent. With ``world_size`` the group is *static*: every
worker starts together and the agent gets all its peers at once (below). With
``world_size=None`` it is *dynamic*: workers join and leave one at a time, and the
agent gains and loses peers as they do (see :mod:`.membership`). A job is one
kind or the other (``rpc/is_static_group`` in the store).

Start-up of a static group (every worker)::

    rendezvous(init_method) ─► store; RPC keys under PrefixStore("rpc/<generation>")
      publish name, read every worker's name ─► duplicates raise "... is not unique"
      connect_mesh (torchdist._transport.mesh): one socket per pair of workers
      authenticate every socket with the job secret (pairs in a global order: no cycle)
        and move it to a Unix socket if the peer is on this host (rpc/same_host.py)
      start the agent (reader threads, thread pool)

Graceful shutdown of a static group (every worker)::

    wait for this worker's calls ─► barrier 1 (worker 0 counts, over RPC)
      delete every UserRRef and wait for the owners' acks ─► barrier 2
      GOODBYE on every connection, close

After barrier 1 no worker issues new work, so what remains are deletions;
after barrier 2 nothing is in flight anywhere. A worker of a dynamic group waits
for its own calls and deletions only, then leaves (``membership.py``).
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

import torch

from .._auth import resolve_secret
from .._store import PrefixStore
from .._store.rendezvous import rendezvous
from ..errors import DistError
from .._transport.mesh import connect_mesh
from ..autograd.context import container as autograd_contexts
from . import rref_context, same_host
from . import membership
from .agent import TcpAgent

if TYPE_CHECKING:
    from .rref import RRef  # imported at call time: rref imports this module
from .constants import DEFAULT_SHUTDOWN_TIMEOUT
from .dispatch import RequestKind, RpcCodec, handle_request
from .handshake import authenticate
from . import backend_registry
from .backend_registry import BackendType
from .options import (DEFAULT_RPC_TIMEOUT_SEC, UNSET_RPC_TIMEOUT, RpcBackendOptions, TensorPipeRpcBackendOptions,
                      WorkerInfo, validate_worker_name)

__all__ = ["init_rpc", "shutdown", "rpc_sync", "rpc_async", "remote", "get_worker_info", "get_rpc_timeout",
           "_set_rpc_timeout", "is_initialized", "is_available"]

logger = logging.getLogger(__name__)

_NOT_INITIALIZED = "RPC has not been initialized. Call torchdist.rpc.init_rpc first."


class _Runtime:
    def __init__(self, me: WorkerInfo, timeout: float, world_size: int | None) -> None:
        self.me = me
        self.timeout = timeout
        self.agent: TcpAgent | None = None
        self.rrefs: rref_context.RRefContext | None = None
        self.barrier = _Barrier(world_size) if world_size else None  # static groups only
        self.membership: membership.Membership | None = None  # dynamic groups only
        self.listener: membership.Listener | None = None
        self.store: Any = None  # kept alive: worker 0 hosts the job's TCPStore server

    def resolve(self, to: str | WorkerInfo | int) -> int:
        if isinstance(to, WorkerInfo):
            to = to.name
        if isinstance(to, str) or (isinstance(to, int) and not isinstance(to, bool)):
            return self.agent.get_worker_info(to).id
        # PyTorch's words: anything else is looked up as a name
        raise ValueError(f"Cannot get WorkerInfo from name {to} (an RPC destination is a worker name, WorkerInfo "
                         f"or rank, got {type(to).__name__})")

    def call_timeout(self, timeout: float | None) -> float:
        """UNSET_RPC_TIMEOUT (-1) or None: the default; 0: no timeout; otherwise seconds
        (another negative one has passed already: the call times out at once, as in PyTorch)."""
        if timeout is None or timeout == UNSET_RPC_TIMEOUT:
            return self.timeout
        return float(timeout)


_runtime: _Runtime | None = None
_init_lock = threading.Lock()


def _get() -> _Runtime:
    runtime = _runtime
    if runtime is None:
        raise RuntimeError(_NOT_INITIALIZED)
    return runtime


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return _runtime is not None


# -- init --------------------------------------------------------------------------------------
def init_rpc(name: str, backend: BackendType | None = None, rank: int = -1, world_size: int | None = None,
             rpc_backend_options: RpcBackendOptions | None = None) -> None:
    """Start this worker's RPC agent and meet the other ``world_size - 1`` workers.

    ``world_size=None``: join a dynamic group instead (this worker's ``rank`` is
    required; see :mod:`.membership`). ``backend``: a member of ``BackendType``
    (see :mod:`.backend_registry`); its init handler gets the rendezvous store.
    """
    backend, options = backend_registry.resolve_backend(backend, rpc_backend_options)
    validate_worker_name(name)
    if world_size is not None and (not isinstance(world_size, int) or world_size <= 0):
        raise ValueError(f"init_rpc: world_size must be a positive int or None (a dynamic group), got {world_size!r}")
    with _init_lock:
        if _runtime is not None:
            raise RuntimeError("RPC is already initialized")
        store_timeout = _store_timeout(options)
        if world_size is None:
            store, rank = membership.dynamic_store(options.init_method, rank, store_timeout)
        else:
            store, rank, world_size = next(rendezvous(options.init_method, rank, world_size, timeout=store_timeout))
        agent = backend_registry.init_backend(backend, store=store, name=name, rank=rank, world_size=world_size,
                                              rpc_backend_options=options)
        _use_agent(backend, agent)
    logger.info("rpc: %s started (%s)", _runtime.me,
                f"{world_size} workers" if world_size else "dynamic group")


def _store_timeout(options: RpcBackendOptions) -> timedelta:
    return timedelta(seconds=options.rpc_timeout if options.rpc_timeout > 0 else DEFAULT_RPC_TIMEOUT_SEC)


def _start_agent(store, name: str, rank: int, world_size: int | None,
                 options: TensorPipeRpcBackendOptions) -> TcpAgent:
    """(init lock held; BackendType.TENSORPIPE's init handler) Start torchdist's agent on the rendezvous store."""
    if _runtime is not None:
        raise RuntimeError("RPC is already initialized")
    validate_worker_name(name)
    timeout = options.rpc_timeout if options.rpc_timeout > 0 else 0.0
    shm = options._transports is None or "shm" in options._transports
    if world_size is None:
        _join_dynamic(store, name, rank, options, timeout, _store_timeout(options), shm)
    else:
        _start_static(store, name, rank, world_size, options, timeout, _store_timeout(options), shm)
    return _runtime.agent


def _use_agent(backend: BackendType, agent: Any) -> None:
    """(init lock held) Make the agent a backend's init handler returned the current one (PyTorch's
    ``_init_rpc_states``): torchdist's own, or an object wrapping it."""
    if _runtime is None:
        raise RuntimeError(f"RPC backend {backend.name}: its init handler returned {agent!r} without starting "
                           "torchdist's agent; a registered backend must start it through "
                           "init_backend(BackendType.TENSORPIPE, ...) and return that agent or a wrapper of it")
    if agent is None:
        raise RuntimeError(f"RPC backend {backend.name}: its init handler returned None instead of the agent")
    _runtime.agent = agent


def _start_static(store, name: str, rank: int, world_size: int, options: TensorPipeRpcBackendOptions,
                  timeout: float, store_timeout: timedelta, shm: bool) -> None:
    """(init lock held) Meet all ``world_size`` workers at once: the membership is known up front."""
    membership.check_group_kind(store, static=True)
    generation = store.add(f"rpc/generation/{rank}", 1)  # init_rpc rounds of one job stay apart
    store = PrefixStore(f"rpc/{generation}", store)
    workers = _gather_names(store, name, rank, world_size)
    sockets = connect_mesh(store, rank, world_size, store_timeout.total_seconds(), list(range(world_size)),
                           f"rpc agent {name}")
    try:
        secret = resolve_secret()  # $TORCHDIST_SECRET; None: the job runs without one
        for peer in sorted(sockets):  # one global order of pairs: handshakes cannot wait in a cycle
            initiator = rank > peer  # connect_mesh: the higher rank of a pair dials
            authenticate(sockets[peer], initiator, repr(workers[peer]), secret, store_timeout.total_seconds())
            sockets[peer] = same_host.upgrade(sockets[peer], initiator, repr(workers[peer]), shm,
                                              store_timeout.total_seconds())
    except BaseException:
        for sock in sockets.values():
            sock.close()
        raise
    runtime = _Runtime(workers[rank], timeout, world_size)
    runtime.store = store
    _start(runtime, {w.id: w for w in workers}, sockets, options.num_worker_threads)


def _join_dynamic(store, name: str, rank: int, options: TensorPipeRpcBackendOptions, timeout: float,
                  store_timeout: timedelta, shm: bool) -> None:
    """(init lock held) Join a dynamic group: connect to its members now, accept later joiners."""
    membership.check_group_kind(store, static=False)
    me = WorkerInfo(name, rank)
    runtime = _Runtime(me, timeout, None)
    runtime.store = store
    runtime.membership = group = membership.Membership(store, me, store_timeout.total_seconds())
    secret = resolve_secret()  # $TORCHDIST_SECRET; None: the job runs without one
    with group.token("join"):
        members = group.claim()
        try:
            sockets = group.connect(members, secret, shm)
        except BaseException:
            group.withdraw()
            raise
        runtime.listener = membership.Listener(group, secret, shm, _on_join)
        workers = {info.id: info for info, _ in members}
        workers[rank] = me
        _start(runtime, workers, sockets, options.num_worker_threads)
        runtime.listener.start()
        group.publish(runtime.listener.address)


def _start(runtime: _Runtime, workers: dict[int, WorkerInfo], sockets: dict, num_threads: int) -> None:
    global _runtime
    runtime.rrefs = rref_context.RRefContext(runtime.me.id, _internal_send)
    rref_context.set_current(runtime.rrefs)
    autograd_contexts.set_worker_id(runtime.me.id)
    runtime.agent = TcpAgent(runtime.me, workers, sockets, num_threads, RpcCodec(), handle_request)
    if runtime.barrier is not None:
        runtime.agent.on_lost = runtime.barrier.lose
    _runtime = runtime
    runtime.agent.start()


def _on_join(info: WorkerInfo, sock, ack: bytes) -> None:
    """(listener thread) A worker joined this dynamic group: serve it, then let it go on."""
    _get().agent.add_peer(info, sock, ack)


def _member_left(worker_id: int) -> None:
    """RPC handler: a member of this dynamic group leaves; it is no destination any more."""
    runtime = _runtime
    if runtime is not None:
        runtime.agent.remove_peer(worker_id)


def _gather_names(store, name: str, rank: int, world_size: int) -> list[WorkerInfo]:
    store.set(f"names/{rank}", name)
    names = [store.get(f"names/{r}").decode() for r in range(world_size)]
    seen: dict[str, int] = {}
    for r, other in enumerate(names):
        if other in seen:
            raise RuntimeError(f"RPC worker name {other} is not unique. Workers {seen[other]} and {r} share the "
                               "same name.")
        seen[other] = r
    return [WorkerInfo(n, r) for r, n in enumerate(names)]


# -- calls -------------------------------------------------------------------------------------
def _context_id(dst: int) -> int:
    context = autograd_contexts.current()
    if context is None:
        return -1
    with context.lock:
        context.peers.add(dst)
    return context.context_id


def rpc_async(to: str | WorkerInfo | int, func: Callable, args: tuple | None = None, kwargs: dict | None = None,
              timeout: float = UNSET_RPC_TIMEOUT) -> torch.futures.Future:
    """Run ``func(*args, **kwargs)`` on ``to``; a ``torch.futures.Future`` of the result."""
    if not callable(func):
        raise TypeError("function should be callable.")
    runtime = _get()
    dst = runtime.resolve(to)
    request = (RequestKind.CALL, func, tuple(args or ()), dict(kwargs or {}), None)
    return runtime.agent.call(dst, request, runtime.call_timeout(timeout), _context_id(dst))


def rpc_sync(to: str | WorkerInfo | int, func: Callable, args: tuple | None = None, kwargs: dict | None = None,
             timeout: float = UNSET_RPC_TIMEOUT) -> Any:
    """Run ``func(*args, **kwargs)`` on ``to`` and return its result (remote errors re-raised here)."""
    return rpc_async(to, func, args, kwargs, timeout).wait()


def remote(to: str | WorkerInfo | int, func: Callable, args: tuple | None = None, kwargs: dict | None = None,
           timeout: float = UNSET_RPC_TIMEOUT) -> RRef:
    """Run ``func`` on ``to`` and keep the result there; returns an RRef to it."""
    from .rref import RRef  # rref imports this module

    if not callable(func):
        raise TypeError("function should be callable.")
    runtime = _get()
    dst = runtime.resolve(to)
    rrefs = runtime.rrefs
    rref_id = rrefs.new_id()
    call_timeout = runtime.call_timeout(timeout)
    if dst == runtime.me.id:  # owned here: run through the pool (arguments copied), the result kept as is
        state = rref_context.OwnerState(rref_id)
        rrefs.expect_local_creation(state)
        request = (RequestKind.REMOTE, func, tuple(args or ()), dict(kwargs or {}), (rref_id, None))
        try:
            future = runtime.agent.call(dst, request, call_timeout, _context_id(dst))
        except BaseException:
            rrefs.take_local_creation(rref_id)
            raise
        future.add_done_callback(lambda fut: _fail_unless_run(rrefs, state, fut))
        return RRef._owner(dst, state)
    fork_id = rrefs.new_id()
    rref = RRef._user(dst, rref_id, fork_id, confirmed=False)
    request = (RequestKind.REMOTE, func, tuple(args or ()), dict(kwargs or {}), (rref_id, fork_id))
    try:
        future = runtime.agent.call(dst, request, call_timeout, _context_id(dst))
    except BaseException:
        rref._discard()  # the request never left: the owner knows no fork to delete
        raise
    rref._creation = future

    def created(fut: torch.futures.Future) -> None:
        try:
            fut.wait()
            rref._set_confirmed()
        except Exception as exc:  # noqa: BLE001 - to_here raises it
            rref._set_confirmed(exc)
    future.add_done_callback(created)
    return rref


def _fail_unless_run(rrefs: rref_context.RRefContext, state: rref_context.OwnerState,
                     call: torch.futures.Future) -> None:
    """A remote() to this worker whose request failed before it ran (a timeout): its error is the value."""
    if rrefs.take_local_creation(state.rref_id) is None:
        return  # the request ran: it set the value
    try:
        call.wait()
    except Exception as exc:  # noqa: BLE001
        state.future.set_exception(exc)


def _internal_send(dst: int, func: Callable, args: tuple) -> torch.futures.Future:
    """Protocol messages (RRef forks and deletions): no autograd context, no timeout."""
    runtime = _get()
    return runtime.agent.call(dst, (RequestKind.CALL, func, args, {}, None), 0.0, -1)


# -- worker infos and timeouts -----------------------------------------------------------------
def get_worker_info(worker_name: str | int | None = None) -> WorkerInfo:
    """This worker's WorkerInfo, or the one of ``worker_name``."""
    runtime = _get()
    if worker_name is None:
        return runtime.me
    return runtime.agent.get_worker_info(worker_name)


def _get_current_rpc_agent() -> TcpAgent:
    """This worker's agent (PyTorch's name): ``get_worker_infos()`` lists the group now."""
    return _get().agent


def get_rpc_timeout() -> float:
    return _get().timeout


def _set_rpc_timeout(rpc_timeout: float) -> None:
    if rpc_timeout < 0:
        raise ValueError(f"rpc_timeout must be >= 0 seconds, got {rpc_timeout}")
    _get().timeout = float(rpc_timeout)


# -- shutdown ----------------------------------------------------------------------------------
class _Barrier:
    """Counted on worker 0: round ``n`` completes when every worker arrived."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.lock = threading.Lock()
        self.rounds: dict[int, dict[int, torch.futures.Future]] = {}
        self.lost: RuntimeError | None = None  # a worker died: no round can complete

    def lose(self, peer: WorkerInfo, error: BaseException) -> None:
        """A worker died: fail the rounds it has not arrived at, and every later arrival."""
        self._fail(RuntimeError(f"rpc.shutdown: {peer.name} was lost before every worker reached the shutdown "
                                f"barrier ({error})"), lambda waiting: peer.id not in waiting)

    def close(self, me: WorkerInfo) -> None:
        """Worker 0 leaves (its shutdown failed or gave up): nobody waits for its barrier any more."""
        self._fail(RuntimeError(f"rpc.shutdown: {me.name}, which holds the shutdown barrier, left before every "
                                "worker reached it"), lambda waiting: True)

    def _fail(self, error: RuntimeError, stranded: Callable[[dict], bool]) -> None:
        failed = []
        with self.lock:
            if self.lost is None:
                self.lost = error
            for round_no, waiting in list(self.rounds.items()):
                if stranded(waiting):
                    failed.extend(self.rounds.pop(round_no).values())
        for future in failed:
            future.set_exception(self.lost)

    def arrive(self, round_no: int, worker_id: int) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        with self.lock:
            if self.lost is not None:
                future.set_exception(self.lost)
                return future
            waiting = self.rounds.setdefault(round_no, {})
            waiting[worker_id] = future
            if len(waiting) < self.world_size:
                return future
            del self.rounds[round_no]
        # Worker 0's own future last: completing a remote arrival sends its reply on
        # this thread, and all replies must be out before worker 0 goes on to close.
        for worker in sorted(waiting, reverse=True):
            waiting[worker].set_result(None)
        return future


def _barrier_arrive(round_no: int, worker_id: int) -> torch.futures.Future:
    return _get().barrier.arrive(round_no, worker_id)


_barrier_arrive._async_execution = True


def _shutdown_barrier(runtime: _Runtime, round_no: int, limit: float | None) -> None:
    """Arrive at worker 0's barrier; wait at most ``limit`` s (None: for ever, as PyTorch's
    default), but never for a worker that died (``_Barrier.lose``)."""
    try:
        rpc_sync(0, _barrier_arrive, args=(round_no, runtime.me.id), timeout=limit or 0)
    except RuntimeError as exc:
        if limit is not None and str(exc).startswith("RPCErr:1:"):  # the call's own timeout
            raise RuntimeError(f"rpc.shutdown on {runtime.me.name}: not every worker reached the shutdown barrier "
                               f"within {limit:.2f} seconds") from exc
        raise


def shutdown(graceful: bool = True, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Stop RPC; graceful waits for every worker's outstanding work first (``timeout`` s, 0 = none)."""
    global _runtime
    runtime = _get()
    limit = timeout if timeout and timeout > 0 else None
    static = runtime.barrier is not None
    try:
        if graceful:
            runtime.agent.wait_idle(limit)
            runtime.rrefs.wait_children(limit or 60.0)
            if static:
                _shutdown_barrier(runtime, 1, limit)
            runtime.rrefs.delete_all_users(limit or 60.0)
            runtime.agent.wait_idle(limit)
            if static:
                _shutdown_barrier(runtime, 2, limit)
        if not static:
            _leave(runtime, notify=graceful)
    finally:
        if static:
            runtime.barrier.close(runtime.me)  # answer what still waits on it (after a failure)
        if runtime.listener is not None:
            runtime.listener.close()
        with _init_lock:
            _runtime = None
            runtime.agent.close(graceful)
            runtime.rrefs.stop()
            rref_context.set_current(None)
            autograd_contexts.clear()
    logger.info("rpc: %s shut down", runtime.me)


def _leave(runtime: _Runtime, notify: bool) -> None:
    """Leave a dynamic group: drop out of the store's membership, then (graceful) tell every member.

    Without the store (worker 0, which hosts it, left first) the members are still
    told: they are known here.
    """
    group = runtime.membership
    told = False
    try:
        with group.token("leave"):
            group.withdraw()
            if notify:
                told = True
                _tell_members_left(runtime)
    except (DistError, OSError) as exc:
        logger.warning("rpc: %s could not update the group's membership in the store (%s); leaving anyway",
                       runtime.me, exc)
    if notify and not told:
        _tell_members_left(runtime)


def _tell_members_left(runtime: _Runtime) -> None:
    futures = [(info, rpc_async(info.id, _member_left, args=(runtime.me.id,), timeout=0))
               for info in runtime.agent.get_worker_infos() if info.id != runtime.me.id]
    for info, future in futures:
        try:
            future.wait()
        except RuntimeError as exc:  # it died or left meanwhile: nothing to tell it
            logger.info("rpc: %s could not tell %s that it leaves: %s", runtime.me, info, exc)
