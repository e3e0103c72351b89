"""Starting and stopping the default process group, and the queries about it."""

from __future__ import annotations

import atexit
import logging
import multiprocessing.util
import os
import secrets
import time
from datetime import timedelta

from .._process_group.process_group import ProcessGroup
from .._process_group.registry import Backend, BackendConfig
from .._process_group.work import settle_future_callbacks
from .._store.base import Store
from .._store.file_store import FileStore
from .._store.tcp_store import TCPStore
from .._store.prefix_store import PrefixStore
from .._store.rendezvous import rendezvous
from ..errors import DistStoreError
from ._args import check_timeout
from .groups import build_group, default_pg_timeout
from .world import NON_GROUP_MEMBER, WORLD

__all__ = [
    "init_process_group",
    "destroy_process_group",
    "is_initialized",
    "is_available",
    "is_torchelastic_launched",
    "get_rank",
    "get_world_size",
    "get_backend",
    "get_backend_config",
    "get_node_local_rank",
    "default_pg_timeout",
]

logger = logging.getLogger(__name__)


def is_available() -> bool:
    """torchdist is always available: it needs nothing beyond torch and sockets."""
    return True


def is_initialized() -> bool:
    return WORLD.default_pg is not None


def is_torchelastic_launched() -> bool:
    """True under an elastic launcher (torchdist-run or torchrun), which sets TORCHELASTIC_RUN_ID."""
    return os.getenv("TORCHELASTIC_RUN_ID") is not None


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Store | None = None,
    group_name: str = "",
    pg_options=None,
    device_id=None,
) -> None:
    """Join the default process group: rendezvous, wait for everyone, build the backend.

    Exactly one of ``init_method`` (default ``"env://"``) and ``store`` says how ranks
    meet. The call returns once all ``world_size`` ranks have arrived, or raises
    ``DistStoreError`` when they have not within ``timeout`` (default 30 minutes).
    """
    if WORLD.default_pg is not None:
        raise ValueError("trying to initialize the default process group twice!")
    check_timeout(timeout)
    timeout = default_pg_timeout if timeout is None else timeout
    if backend is not None:
        backend = Backend(backend)

    if store is not None:
        if init_method is not None:
            raise AssertionError("Cannot specify both init_method and store.")  # PyTorch's types, here and below
        if world_size <= 0:
            raise AssertionError(f"world_size must be positive if using store, got {world_size}")
        if rank < 0:
            raise AssertionError(f"rank must be non-negative if using store, got {rank}")
        if rank >= world_size:
            raise ValueError(f"rank {rank} is out of range for world_size {world_size} (ranks are 0..{world_size - 1})")
        owns_store = False
    elif backend == Backend.MPI:  # rank and size come from MPI, as with PyTorch (init_method is ignored)
        from .._process_group.backends.mpi import rendezvous_over_mpi  # (imports mpi4py, which starts MPI)

        store, rank, world_size = rendezvous_over_mpi(rank, world_size, timeout)
        owns_store = True
    else:
        store, rank, world_size = _rendezvous(init_method or "env://", rank, world_size, timeout)
        owns_store = True
    # The store inherits the group's timeout, so a missing peer surfaces as an error in time.
    store.set_timeout(timeout)

    # Wait for every rank before building the backend: the mesh bootstrap needs all of
    # them anyway, and a rank that never comes is best reported by this barrier.
    try:
        if os.environ.get("TORCH_DIST_INIT_BARRIER", "1") != "0":
            _store_based_barrier(PrefixStore("init", store), rank, world_size, timeout)
    except BaseException:
        if owns_store:
            _close_store(store)
        raise

    WORLD.store, WORLD.owns_store = store, owns_store
    _arm_exit_hook()
    try:
        pg = build_group(
            ranks=list(range(world_size)),
            my_global_rank=rank,
            backend=backend,
            timeout=timeout,
            group_name="0",  # as in torch, the deprecated group_name is ignored: names are counters
            group_desc="default_pg",
            pg_options=pg_options,
        )
    except BaseException:
        _tear_down()
        raise
    WORLD.default_pg = pg
    WORLD.register(pg)
    logger.info("rank %d joined the default process group (world_size=%d, backend=%s)", rank, world_size, pg.name())


#: Per TCPStore address: a key this process left on the server of its last default group.
_LEFT_ON: dict[tuple[str, int], str] = {}


def _rendezvous(init_method: str, rank: int, world_size: int, timeout: timedelta) -> tuple[Store, int, int]:
    """``rendezvous()``, but never onto the TCPStore server of this process's previous group.

    A process that destroys its group and initializes again on the same address can
    reach the old server (the master still drains it, or has not destroyed its group
    yet), read the previous group's keys and lose the server under it. Every init
    leaves a key of its own on the server; a client that finds its last one hangs up
    and retries until a new server answers (the old one refuses newcomers once it
    drains: see ``TCPServer.stop``).
    """
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
        if not isinstance(store, TCPStore):
            return store, rank, world_size
        where = (store.host, store.port)
        previous = _LEFT_ON.get(where)
        if previous is None or not store.check([previous]):
            _LEFT_ON[where] = mark = f"torchdist/init/{secrets.token_hex(8)}"
            store.set(mark, b"")
            return store, rank, world_size
        store.close()
        if time.monotonic() > deadline:
            raise DistStoreError(
                f"init_process_group on rank {rank}: the TCPStore at {where[0]}:{where[1]} is still the one of "
                f"this process's previous process group after {timeout}; the rank hosting it (rank 0) did not "
                "destroy its group and start a new store. Call destroy_process_group() on every rank.")
        time.sleep(0.05)


def _store_based_barrier(store: Store, rank: int, world_size: int, timeout: timedelta) -> None:
    """Return once every rank has arrived, or raise naming the ranks that did not.

    Only ``set``, ``get`` and ``wait`` (``Store.arrive_and_wait``): a user's store passed
    to init_process_group needs nothing more, as with PyTorch.

    Every rank also compares its world size with rank 0's: ranks started with different
    sizes would otherwise meet, and the smaller group's ranks compute wrong results. A
    rank that disagrees arrives anyway before it raises, so that rank 0 (whose barrier
    then completes, if its group is the smaller one) finds the difference at once.
    """
    key = "store_based_barrier_key"
    store.set(f"world_size/{rank}", str(world_size))
    try:
        if rank != 0:
            theirs = int(store.get("world_size/0"))  # rank 0 sets it first thing: waits for its arrival
            if theirs != world_size:
                store.set(f"{key}/{rank}", b"1")
                raise ValueError(_size_mismatch(rank, world_size, 0, theirs))
        store.arrive_and_wait(key, rank, world_size, timeout)
    except DistStoreError as exc:
        raise DistStoreError(
            f"Timed out initializing process group in store based barrier on rank {rank}, for key: {key} "
            f"(world_size={world_size}, timeout={timeout}): {exc} Check that every rank was started with the "
            "same world size and rendezvous address."
        ) from exc
    if rank == 0:  # one round trip for all ranks (a store without multi_get gets them one by one)
        sizes = store.multi_get([f"world_size/{peer}" for peer in range(1, world_size)])
        for peer, theirs in enumerate((int(size) for size in sizes), start=1):
            if theirs != world_size:
                raise ValueError(_size_mismatch(rank, world_size, peer, theirs))


def _size_mismatch(rank: int, world_size: int, peer: int, theirs: int) -> str:
    return (f"init_process_group: rank {rank} was started with world_size={world_size} but rank {peer} with "
            f"world_size={theirs}; start every rank with the same world size (WORLD_SIZE, or --nnodes x "
            "--nproc-per-node).")


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Shut down ``group``, or with no argument every group (init may then run again)."""
    if group is NON_GROUP_MEMBER:
        return
    if group is None and WORLD.default_pg is None:
        raise AssertionError("Process group cannot be None: destroy_process_group() needs an initialized "
                             "default group (init_process_group)")
    if group is not None and not isinstance(group, ProcessGroup):
        raise ValueError(f"Invalid process group specified: {group!r}")
    if group is None or group is WORLD.default_pg:
        _tear_down()
        return
    pg = WORLD.resolve(group)
    pg.shutdown()
    WORLD.unregister(pg)


#: How long the interpreter's exit waits for future callbacks still running (s).
_EXIT_CALLBACKS_S = 10.0


#: The process whose exit hooks are armed (a forked child inherits the flag, not the hooks).
_armed_pid: int | None = None
_quiesced = False


def _arm_exit_hook() -> None:
    """Have :func:`_quiesce_at_exit` run when this process exits, however it exits normally.

    The interpreter runs ``atexit`` handlers, but a ``multiprocessing`` child (``mp.spawn``'s
    workers, a Pool's) leaves through ``os._exit`` after running multiprocessing's own
    finalizers, and a forked child starts with that registry cleared: so both are armed here,
    in the process that initializes, and the first to run does the work.
    """
    global _armed_pid
    if _armed_pid != os.getpid():
        _armed_pid = os.getpid()
        atexit.register(_quiesce_at_exit)
        multiprocessing.util.Finalize(None, _quiesce_at_exit, exitpriority=10)


def _quiesce_at_exit() -> None:
    """Finish every live group's outstanding ops and stop its threads before the
    interpreter finalizes (an async op never waited on still runs; gloo finishes
    them too), and let running future callbacks return. Groups the program
    destroyed are gone from the registry already.

    A process that hosts the job's TCPStore then lets the other ranks hang up first, as
    destroy_process_group does: ranks still running may need it (to create a group
    this rank is not in, say), and would fail on a store that vanished under them."""
    global _quiesced
    if _quiesced:  # armed twice (see _arm_exit_hook)
        return
    _quiesced = True
    for pg in list(WORLD.groups.values()):
        try:
            pg._backend.quiesce()
        except Exception:  # noqa: BLE001 - never fail an exit
            logger.debug("quiescing %r at exit failed", pg, exc_info=True)
    if not settle_future_callbacks(_EXIT_CALLBACKS_S):
        logger.warning("a future callback was still running %.0f s into the interpreter's exit", _EXIT_CALLBACKS_S)
    if WORLD.owns_store:
        try:
            _close_store(WORLD.store)
        except Exception:  # noqa: BLE001 - never fail an exit
            logger.debug("closing the store at exit failed", exc_info=True)


def _tear_down() -> None:
    """Shut down every group, forget them, and close the store init_process_group made."""
    for pg in list(WORLD.groups.values()):  # the default group is registered too
        pg.shutdown()
    store, owned = WORLD.store, WORLD.owns_store
    WORLD.reset()
    if owned:
        _close_store(store)


#: How long the rank hosting the job's TCPStore waits, when the group is destroyed, for
#: the other ranks to hang up before it stops the server under them.
STORE_DRAIN_SECONDS = 10.0


def _close_store(store: Store) -> None:
    """Close a store init_process_group made; a TCPStore host first lets its clients leave."""
    if isinstance(store, TCPStore):
        store.close(drain=STORE_DRAIN_SECONDS)
    elif isinstance(store, FileStore):
        store.close()


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (global rank by default); -1 for a non-member."""
    if _not_a_group(group):
        raise ValueError(f"Group {group!r} is not registered, please create group with torchdist.new_group API")
    pg = WORLD.resolve(group)
    return -1 if pg is NON_GROUP_MEMBER else pg.rank()


def get_world_size(group: ProcessGroup | None = None) -> int:
    pg = WORLD.resolve(group)
    return -1 if pg is NON_GROUP_MEMBER else pg.size()


def get_backend(group: ProcessGroup | None = None) -> Backend:
    if _not_a_group(group):
        raise ValueError(f"Process group {group!r} is not initialized in the world group map. Please initialize "
                         "the group first.")
    pg = WORLD.resolve(group)
    if pg is NON_GROUP_MEMBER:
        raise ValueError("Invalid process group specified")
    return Backend(pg.name())


def get_backend_config(group: ProcessGroup | None = None) -> str:
    """Which backend serves which device for ``group``, as ``"cpu:<backend>"`` (torchdist runs on CPU only;
    PyTorch's gloo says ``"cpu:gloo,cuda:gloo"``)."""
    return repr(BackendConfig(get_backend(group)))


def _not_a_group(group: object) -> bool:
    """Neither a group nor None: get_rank and get_backend say ValueError, as PyTorch's."""
    return group is not None and group is not NON_GROUP_MEMBER and not isinstance(group, ProcessGroup)


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """LOCAL_RANK from the launcher's environment, else ``fallback_rank``."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError(
        "LOCAL_RANK is not in the environment. Consider passing fallback_rank to allow "
        "`get_node_local_rank` to work, assuming you are not running in a multi-device context "
        "and want the code to run locally instead."
    )

