"""The RPC entry points: ``init_rpc``, ``shutdown``, ``rpc_sync``/``rpc_async``/``remote``, worker infos.

One :class:`_Runtime` per process holds everything ``init_rpc`` built (agent, RRef
context, the job's worker infos, the default timeout); ``shutdown`` tears it down,
after which ``init_rpc`` may be called again.

Start-up (every worker)::

    rendezvous(init_method) ─► store; RPC keys under PrefixStore("rpc/<generation>")
      publish name, read every worker's name ─► duplicates raise "... is not unique"
      connect_mesh (torchdist._transport.mesh): one socket per pair of workers
      authenticate every socket with the job secret (pairs in a global order: no cycle)
        and move it to a Unix socket if the peer is on this host (rpc/same_host.py)
      start the agent (reader threads, thread pool)

Graceful shutdown (every worker)::

    wait for this worker's calls ─► barrier 1 (worker 0 counts, over RPC)
      delete every UserRRef and wait for the owners' acks ─► barrier 2
      GOODBYE on every connection, close

After barrier 1 no worker issues new work, so what remains are deletions;
after barrier 2 nothing is in flight anywhere.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Any, Callable

import torch

from .._store import PrefixStore
from .._store.rendezvous import rendezvous
from .._transport.mesh import connect_mesh
from ..autograd.context import container as autograd_contexts
from . import rref_context, same_host
from .agent import TcpAgent
from .dispatch import RequestKind, RpcCodec, handle_request
from .handshake import authenticate, job_secret
from .options import (DEFAULT_RPC_TIMEOUT_SEC, UNSET_RPC_TIMEOUT, BackendType, RpcBackendOptions,
                      TensorPipeRpcBackendOptions, WorkerInfo, validate_worker_name)

__all__ = ["init_rpc", "shutdown", "rpc_sync", "rpc_async", "remote", "get_worker_info", "get_rpc_timeout",
           "_set_rpc_timeout", "is_initialized", "is_available"]

logger = logging.getLogger(__name__)

_NOT_INITIALIZED = "RPC has not been initialized. Call torchdist.rpc.init_rpc first."


class _Runtime:
    def __init__(self, me: WorkerInfo, workers: list[WorkerInfo], timeout: float) -> None:
        self.me = me
        self.workers = workers
        self.by_name = {w.name: w for w in workers}
        self.timeout = timeout
        self.agent: TcpAgent | None = None
        self.rrefs: rref_context.RRefContext | None = None
        self.barrier = _Barrier(len(workers))
        self.store: Any = None  # kept alive: worker 0 hosts the job's TCPStore server

    def resolve(self, to: str | WorkerInfo | int) -> int:
        if isinstance(to, WorkerInfo):
            to = to.name
        if isinstance(to, str):
            info = self.by_name.get(to)
            if info is None:
                raise RuntimeError(f"name:{self.me.name},rank:{self.me.id} could not find destination name {to}")
            return info.id
        if isinstance(to, int) and not isinstance(to, bool):
            if not 0 <= to < len(self.workers):
                raise RuntimeError(f"name:{self.me.name},rank:{self.me.id} could not find destination id {to}")
            return to
        raise TypeError(f"RPC destination must be a worker name, WorkerInfo or rank, got {type(to).__name__}")

    def call_timeout(self, timeout: float | None) -> float:
        """<0 (unset): the default; 0: no timeout; >0: seconds."""
        if timeout is None or timeout < 0:
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
    """Start this worker's RPC agent and meet the other ``world_size - 1`` workers."""
    global _runtime
    if backend is not None and backend != BackendType.TENSORPIPE:
        raise TypeError(f"Argument backend must be a member of BackendType, got {backend!r}")
    options = rpc_backend_options if rpc_backend_options is not None else TensorPipeRpcBackendOptions()
    if not isinstance(options, TensorPipeRpcBackendOptions):
        raise TypeError(f"`rpc_backend_options` must be a `TensorPipeRpcBackendOptions`, got {type(options)}")
    validate_worker_name(name)
    if world_size is None:
        raise ValueError("torchdist.rpc needs a static world: pass world_size to init_rpc "
                         "(dynamic membership, world_size=None, is not supported)")
    with _init_lock:
        if _runtime is not None:
            raise RuntimeError("RPC is already initialized")
        timeout = options.rpc_timeout if options.rpc_timeout > 0 else 0.0
        store_timeout = timedelta(seconds=timeout or DEFAULT_RPC_TIMEOUT_SEC)
        store, rank, world_size = next(rendezvous(options.init_method, rank, world_size, timeout=store_timeout))
        generation = store.add(f"rpc/generation/{rank}", 1)  # init_rpc rounds of one job stay apart
        store = PrefixStore(f"rpc/{generation}", store)
        workers = _gather_names(store, name, rank, world_size)
        runtime = _Runtime(workers[rank], workers, timeout)
        runtime.store = store
        sockets = connect_mesh(store, rank, world_size, store_timeout.total_seconds(), list(range(world_size)),
                               f"rpc agent {name}")
        try:
            secret = job_secret()
            shm = options._transports is None or "shm" in options._transports
            for peer in sorted(sockets):  # one global order of pairs: handshakes cannot wait in a cycle
                authenticate(sockets[peer], rank, peer, repr(workers[peer]), secret, store_timeout.total_seconds())
                sockets[peer] = same_host.upgrade(sockets[peer], rank, peer, repr(workers[peer]), shm,
                                                  store_timeout.total_seconds())
        except BaseException:
            for sock in sockets.values():
                sock.close()
            raise
        runtime.rrefs = rref_context.RRefContext(rank, _internal_send)
        rref_context.set_current(runtime.rrefs)
        autograd_contexts.set_worker_id(rank)
        runtime.agent = TcpAgent(runtime.me, {w.id: w for w in workers}, sockets, options.num_worker_threads,
                                 RpcCodec(), handle_request)
        _runtime = runtime
        runtime.agent.start()
    logger.info("rpc: %s started (%d workers)", runtime.me, world_size)


def _gather_names(store, name: str, rank: int, world_size: int) -> list[WorkerInfo]:
    store.set(f"names/{rank}", name)
    names = [store.get(f"names/{r}").decode() for r in range(world_size)]
    seen: dict[str, int] = {}
    for r, other in enumerate(names):
        if other in seen:
            raise RuntimeError(f"RPC worker name {other} is not unique. Workers {seen[other]} and {r} share it.")
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
    runtime = _get()
    dst = runtime.resolve(to)
    request = (RequestKind.CALL, func, tuple(args or ()), dict(kwargs or {}), None)
    return runtime.agent.call(dst, request, runtime.call_timeout(timeout), _context_id(dst))


def rpc_sync(to: str | WorkerInfo | int, func: Callable, args: tuple | None = None, kwargs: dict | None = None,
             timeout: float = UNSET_RPC_TIMEOUT) -> Any:
    """Run ``func(*args, **kwargs)`` on ``to`` and return its result (remote errors re-raised here)."""
    return rpc_async(to, func, args, kwargs, timeout).wait()


def remote(to: str | WorkerInfo | int, func: Callable, args: tuple | None = None, kwargs: dict | None = None,
           timeout: float = UNSET_RPC_TIMEOUT):
    """Run ``func`` on ``to`` and keep the result there; returns an RRef to it."""
    from .rref import RRef  # rref imports this module

    runtime = _get()
    dst = runtime.resolve(to)
    rrefs = runtime.rrefs
    rref_id = rrefs.new_id()
    call_timeout = runtime.call_timeout(timeout)
    if dst == runtime.me.id:  # owned here: run through the pool, the value stays local
        state = rref_context.OwnerState(rref_id)
        request = (RequestKind.CALL, func, tuple(args or ()), dict(kwargs or {}), None)
        future = runtime.agent.call(dst, request, call_timeout, _context_id(dst))
        future.add_done_callback(lambda fut: _settle(state.future, fut))
        return RRef._owner(dst, state)
    fork_id = rrefs.new_id()
    rref = RRef._user(dst, rref_id, fork_id, confirmed=False)
    request = (RequestKind.REMOTE, func, tuple(args or ()), dict(kwargs or {}), (rref_id, fork_id))
    future = runtime.agent.call(dst, request, call_timeout, _context_id(dst))
    rref._creation = future

    def created(fut: torch.futures.Future) -> None:
        try:
            fut.wait()
            rref._set_confirmed()
        except Exception as exc:  # noqa: BLE001 - to_here raises it
            rref._set_confirmed(exc)
    future.add_done_callback(created)
    return rref


def _settle(target: torch.futures.Future, source: torch.futures.Future) -> None:
    try:
        target.set_result(source.wait())
    except Exception as exc:  # noqa: BLE001
        target.set_exception(exc)


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
    return runtime.workers[runtime.resolve(worker_name)]


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
        self.rounds: dict[int, list[torch.futures.Future]] = {}

    def arrive(self, round_no: int, worker_id: int) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        with self.lock:
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


def shutdown(graceful: bool = True, timeout: float = 0) -> None:
    """Stop RPC; graceful waits for every worker's outstanding work first (``timeout`` s, 0 = none)."""
    global _runtime
    runtime = _get()
    limit = timeout if timeout and timeout > 0 else None
    try:
        if graceful:
            runtime.agent.wait_idle(limit)
            runtime.rrefs.wait_children(limit or 60.0)
            rpc_sync(0, _barrier_arrive, args=(1, runtime.me.id), timeout=0)
            runtime.rrefs.delete_all_users(limit or 60.0)
            runtime.agent.wait_idle(limit)
            rpc_sync(0, _barrier_arrive, args=(2, runtime.me.id), timeout=0)
    finally:
        with _init_lock:
            _runtime = None
            runtime.agent.close(graceful)
            runtime.rrefs.stop()
            rref_context.set_current(None)
            autograd_contexts.clear()
    logger.info("rpc: %s shut down", runtime.me)
