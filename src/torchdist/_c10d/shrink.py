"""``shrink_group``: rebuild a process group without some of its ranks, typically ranks that died.

The fault-tolerance use: a rank is SIGKILLed (or hangs for good); the survivors agree which
ranks are gone and call ``shrink_group(ranks_to_exclude)``; they get a new group of
themselves, renumbered 0..n-1 in their old order, and carry on. PyTorch implements it only
for NCCL (``ncclCommShrink``); its gloo raises TypeError. Every torchdist CPU backend (tcp,
shm, auto) supports it, because a torchdist group is rebuilt the way it was built: through
the job's store.

How it works, on each survivor, without a word to the excluded ranks::

    validate (PyTorch's checks, types and messages)
      -> SHRINK_ABORT: abort the parent group (its pending Work raises, on every survivor)
      -> meet the other survivors in the store, under a prefix they all compute alike
         (parent name + a per-parent shrink counter), within the parent's timeout;
         a survivor that does not come is named in the DistStoreError
      -> build the new group's backend through the store, as new_group does
      -> default group shrunk: destroy every other group, then the old default group
         (locally: no message to its dead members); the new group becomes the default,
         and later groups live in a store namespace of their own
         any other group: destroy it, register the new one

Global ranks after shrinking the default group: as in PyTorch, the survivors are renumbered,
and the new numbering *is* the global numbering from then on: ``get_rank()`` and
``get_world_size()`` report it, ``new_group(ranks)`` takes it, and ``get_global_rank`` on the
default group is the identity. (PyTorch's ``get_process_group_ranks`` of the new default group
still lists the survivors' old global ranks, which contradicts the rest; torchdist lists
0..n-1.) Shrinking any other group keeps global ranks: the new group's members are the
parent's global ranks less the excluded ones.

A failed shrink (a survivor missing, a bootstrap error) leaves the parent registered (aborted,
with SHRINK_ABORT); a retry uses the next counter value, hence a fresh prefix, so every
survivor must retry the same number of times.

The job's store must outlive the excluded ranks: with ``env://`` rank 0 hosts the TCPStore,
so rank 0 cannot be shrunk away unless the store is hosted elsewhere (torchdist-run's agent,
a FileStore, a store passed to init_process_group).
"""

from __future__ import annotations

import logging

from .._process_group.registry import DEFAULT_CPU_BACKEND, resolve_cpu_backend
from .._store.prefix_store import PrefixStore
from ..errors import DistNetworkError, DistStoreError
from .groups import build_group
from .process_group_ops import ProcessGroup
from .world import NON_GROUP_MEMBER, WORLD

__all__ = ["shrink_group", "SHRINK_DEFAULT", "SHRINK_ABORT"]

logger = logging.getLogger(__name__)

#: Shrink without touching what the parent group has in flight (PyTorch's value).
SHRINK_DEFAULT = 0
#: Abort the parent group's in-flight ops first: their Work raises (PyTorch's value).
SHRINK_ABORT = 1

#: The built-in backends that rebuild through the store. Others (mpi: one communicator that a
#: dead rank breaks for good) support shrinking only if their backend says ``supports_shrinking``.
_SHRINKABLE_BACKENDS = frozenset({"tcp", "shm", "auto"})


def shrink_group(
    ranks_to_exclude: list[int],
    group: ProcessGroup | None = None,
    shrink_flags: int = SHRINK_DEFAULT,
    pg_options=None,
) -> ProcessGroup:
    """A new group of ``group``'s ranks (default: the default group) less ``ranks_to_exclude``.

    ``ranks_to_exclude`` are ranks of ``group``. Only the remaining ranks call it, all with
    the same arguments; the excluded ones may be dead. The parent group is destroyed; if it
    was the default group, every other group is destroyed too and the new group becomes the
    default. ``pg_options`` go to the new group's backend, as with ``new_group``.

    Raises TypeError or ValueError for bad arguments (PyTorch's checks and messages),
    RuntimeError if this rank is among the excluded, TypeError if the group's backend cannot
    shrink, DistStoreError naming the remaining ranks that did not call it within the parent
    group's timeout, and ValueError when the remaining ranks disagree about ``ranks_to_exclude``
    (the excluded ranks are checked, not put in the new group's name).
    """
    _validate_inputs(ranks_to_exclude, shrink_flags)
    parent = _target_group(group)
    _require_shrinkable(parent)
    excluded = _validate_excluded(ranks_to_exclude, parent)
    is_default = parent is WORLD.default_pg
    remaining = [r for r in range(parent.size()) if r not in excluded]  # ranks of the parent group

    count = WORLD.shrink_count[parent.group_name] = WORLD.shrink_count.get(parent.group_name, 0) + 1
    name = f"{parent.group_name}~shrink{count}"
    if shrink_flags == SHRINK_ABORT:
        _discard(parent, abort=True)  # before the rendezvous: the survivors' pending ops fail now
    _meet_survivors(parent, remaining, sorted(excluded), name)

    # After a default group's shrink the survivors' new ranks are the global ranks.
    global_ranks = list(range(len(remaining))) if is_default else [parent.global_ranks[r] for r in remaining]
    me = global_ranks[remaining.index(parent.rank())]
    backend = None if parent.name() == DEFAULT_CPU_BACKEND else parent.name()
    desc = "default:shrunken" if is_default else f"{parent.group_name}:shrunk"  # PyTorch's descriptions
    new_pg = build_group(ranks=global_ranks, my_global_rank=me, backend=backend, timeout=parent.timeout,
                         group_name=name, group_desc=desc, pg_options=pg_options)

    abort = shrink_flags == SHRINK_ABORT
    if is_default:
        _destroy_other_groups(parent, abort)
    _discard(parent, abort)
    WORLD.unregister(parent)
    if is_default:
        WORLD.default_pg = new_pg
        # Later groups are named by counters and member lists, which now mean other processes than
        # before: give them a store namespace of their own, so they meet no key of an old group.
        WORLD.store_prefix = f"{WORLD.store_prefix}{name}~groups/"
        WORLD.local_group_count.clear()
    WORLD.register(new_pg)
    logger.info("shrank process group %r to %r without its ranks %s: rank %d of %d", parent.group_name, name,
                sorted(excluded), new_pg.rank(), new_pg.size())
    return new_pg


# -- validation: PyTorch's checks, in its order, with its types and messages -------------------
def _validate_inputs(ranks_to_exclude: list[int], shrink_flags: int) -> None:
    if not isinstance(ranks_to_exclude, list):
        raise TypeError(
            f"ranks_to_exclude must be a list, but got {type(ranks_to_exclude).__name__}. "
            f"Example: [1, 3, 5] to exclude ranks 1, 3, and 5."
        )
    if not ranks_to_exclude:
        raise ValueError(
            "ranks_to_exclude cannot be empty. To shrink a group, you must specify at least "
            "one rank to exclude. Example: [failed_rank_id]"
        )
    if not isinstance(shrink_flags, int) or shrink_flags not in (SHRINK_DEFAULT, SHRINK_ABORT):
        raise ValueError(
            f"Invalid shrink_flags value: {shrink_flags}. Must be one of: "
            f"SHRINK_DEFAULT ({SHRINK_DEFAULT}) or SHRINK_ABORT ({SHRINK_ABORT}). "
            f"Use SHRINK_ABORT to abort ongoing operations before shrinking."
        )


def _target_group(group: ProcessGroup | None) -> ProcessGroup:
    """``group``, or the default group; ValueError for a group of one (nothing to shrink)."""
    pg = WORLD.resolve(group)  # ValueError before init_process_group, or for a destroyed group
    if pg is NON_GROUP_MEMBER:
        raise RuntimeError("shrink_group: this rank is not a member of the group to shrink "
                           "(new_group gave it GroupMember.NON_GROUP_MEMBER); only its members call shrink_group")
    if pg.size() <= 1:
        raise ValueError(
            f"Cannot shrink a process group with size {pg.size()}. "
            f"Group must have at least 2 ranks to support shrinking."
        )
    return pg


def _require_shrinkable(pg: ProcessGroup) -> None:
    impl = pg._backend  # (not pg.backend, which raises once a failed SHRINK_ABORT aborted the group: retries)
    supports = getattr(impl, "supports_shrinking", None)
    if supports is None:
        try:
            supports = resolve_cpu_backend(pg.name()) in _SHRINKABLE_BACKENDS
        except ValueError:
            supports = False
    if not supports:
        raise TypeError(f"Process group backend for '{pg.group_name}' does not support shrinking operations.")


def _validate_excluded(ranks_to_exclude: list[int], pg: ProcessGroup) -> set[int]:
    size, me = pg.size(), pg.rank()
    excluded: set[int] = set()
    for i, rank in enumerate(ranks_to_exclude):
        if not isinstance(rank, int):
            raise TypeError(
                f"All elements in ranks_to_exclude must be integers. "
                f"Element at index {i} is {type(rank).__name__}: {rank}"
            )
        if not 0 <= rank < size:
            raise ValueError(
                f"Rank {rank} at index {i} is out of bounds for group size {size}. "
                f"Valid ranks are in range [0, {size - 1}]."
            )
        if rank in excluded:
            raise ValueError(
                f"Duplicate rank {rank} found in ranks_to_exclude at index {i}. "
                f"Each rank can only be excluded once."
            )
        excluded.add(rank)
    if len(excluded) >= size:
        raise ValueError(
            f"Cannot exclude all {size} ranks from process group. "
            f"At least one rank must remain. Excluding {len(excluded)} ranks."
        )
    if me in excluded:
        raise RuntimeError(
            f"Current rank {me} is in the exclusion list and should not call shrink_group(). "
            f"Only non-excluded ranks should participate in the shrinking operation. "
            f"Excluded ranks should terminate their processes instead."
        )
    return excluded


# -- the survivors' rendezvous -------------------------------------------------------------------
def _meet_survivors(parent: ProcessGroup, remaining: list[int], excluded: list[int], name: str) -> None:
    """Return once every remaining rank has called shrink_group for ``name``, with the same
    ``excluded``; DistStoreError naming those that did not come within the parent's timeout.

    Each survivor sets ``<parent group rank>`` = its excluded list under the prefix of the
    shrunk group's name, then waits for the others' keys: only the survivors' keys, so that
    the excluded ranks, dead or alive, take no part.
    """
    store = PrefixStore(f"{WORLD.store_prefix}{name}~arrivals/", WORLD.store)
    me, timeout = parent.rank(), parent.timeout
    label = f"shrink_group of process group {parent.group_name!r} on its rank {me}"
    mine = ",".join(map(str, excluded))
    try:
        store.set(str(me), mine)
        try:
            store.wait([str(r) for r in remaining], timeout)
        except DistStoreError as exc:
            missing = [r for r in remaining if not store.check([str(r)])]
            raise DistStoreError(
                f"{label}: timed out after {timeout} waiting for the other remaining ranks; ranks {missing} of the "
                f"group (global ranks {[parent.global_ranks[r] for r in missing]}) did not call shrink_group "
                f"(excluding {excluded}). Every rank not excluded must call it, with the same ranks_to_exclude, "
                "as many times as the others."
            ) from exc
        theirs = dict(zip(remaining, store.multi_get([str(r) for r in remaining])))
    except DistNetworkError as exc:
        raise DistStoreError(
            f"{label}: the job's store is unreachable ({exc}); it must outlive the excluded ranks (with env:// "
            "rank 0 hosts it, so rank 0 cannot be excluded)"
        ) from exc
    differ = {r: value.decode() for r, value in theirs.items() if value.decode() != mine}
    if differ:
        raise ValueError(f"{label}: the remaining ranks disagree about ranks_to_exclude: this rank excludes "
                         f"[{mine}], ranks {sorted(differ)} exclude {[f'[{v}]' for v in differ.values()]}")


# -- destroying the old groups, without a word to dead ranks ---------------------------------------
def _destroy_other_groups(default: ProcessGroup, abort: bool) -> None:
    """Every group but the default one: their ranks mean other processes once it shrinks."""
    others = [pg for pg in WORLD.groups.values() if pg is not default]
    if others:
        logger.warning(
            "Shrinking default group will destroy %d other process groups: %s. This is necessary because shrinking "
            "the default group reassigns global ranks, making existing groups inconsistent.",
            len(others), ", ".join(pg.group_name for pg in others))
    for pg in others:
        _discard(pg, abort)
        WORLD.unregister(pg)


def _discard(pg: ProcessGroup, abort: bool) -> None:
    """Close ``pg`` on this rank only: ``abort`` fails what is in flight at once, otherwise queued
    ops finish first (or fail: a dead peer's connection is gone). Never raises, as PyTorch's
    cleanup logs and goes on: the group's peers may be dead."""
    try:
        if abort:
            pg.abort()
        else:
            pg.shutdown()
    except Exception:  # noqa: BLE001 - a broken group's close may fail; the shrink goes on
        logger.warning("closing process group %r while shrinking failed", pg.group_name, exc_info=True)
