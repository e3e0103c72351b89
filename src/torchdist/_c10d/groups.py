"""Creating groups (``new_group``, subgroups, ``split_group``) and mapping ranks.

Every group gets a name equal on all its members (see ``World.next_group_name``);
its store is the job's store under the prefix ``"<name>/"`` (behind ``WORLD.store_prefix``
once shrink_group replaced the default group), so each group's
backend bootstraps (exchanges addresses) without colliding with any other group.
"""

from __future__ import annotations

from datetime import timedelta

from .process_group_ops import ProcessGroup
from .._process_group.registry import DEFAULT_CPU_BACKEND, Backend, create_backend
from .._store.base import as_timedelta
from .._store.prefix_store import PrefixStore
from ._args import check_timeout
from .world import NON_GROUP_MEMBER, WORLD

__all__ = [
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "split_group",
    "get_group_rank",
    "get_global_rank",
    "get_process_group_ranks",
    "get_pg_count",
    "default_pg_timeout",
]


#: PyTorch's default timeout for CPU process groups: init_process_group's, and any group's
#: created without one (not its parent's, as in PyTorch).
default_pg_timeout = timedelta(minutes=30)


def build_group(
    *,
    ranks: list[int],
    my_global_rank: int,
    backend: str | None,
    timeout: timedelta,
    group_name: str,
    group_desc: str,
    pg_options=None,
) -> ProcessGroup:
    """Construct this rank's ProcessGroup over global ``ranks`` (group rank i = ranks[i])."""
    store = PrefixStore(f"{WORLD.store_prefix}{group_name}/", WORLD.store)
    impl = create_backend(backend, store, ranks.index(my_global_rank), len(ranks), timeout, group_name=group_name,
                          global_ranks=ranks, pg_options=pg_options)
    return ProcessGroup(
        impl,
        backend_name=str(Backend(backend)) if backend is not None else DEFAULT_CPU_BACKEND,
        global_ranks=ranks,
        group_name=group_name,
        group_desc=group_desc,
        store=store,
        timeout=timeout,
    )


def new_group(
    ranks: list[int] | None = None,
    timeout: timedelta | None = None,
    backend: str | None = None,
    pg_options=None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id=None,
    sort_ranks: bool = True,
) -> ProcessGroup:
    """A group of ``ranks`` (global ranks). Every rank of the world calls it, in the
    same order, unless ``use_local_synchronization`` (then only members call it).
    Ranks outside the group get ``GroupMember.NON_GROUP_MEMBER``.
    """
    default = WORLD.require_default()
    check_timeout(timeout)
    world_size = default.size()
    if ranks is not None:
        if not ranks:
            raise TypeError("new_group: ranks is empty; give the members' global ranks, or None for every rank")
        if not all(isinstance(r, int) for r in ranks):
            raise TypeError(f"new_group: ranks must be ints (global ranks), got {ranks!r}")
    ranks = list(range(world_size)) if ranks is None else list(ranks)
    for r in ranks:
        if not 0 <= r < world_size:
            raise ValueError(f"new_group: rank {r} is out of range for world size {world_size}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"new_group: ranks must be unique, got {ranks}")
    if sort_ranks:
        ranks = sorted(ranks)
    name = WORLD.next_group_name(ranks, use_local_synchronization)
    me = default.rank()
    if me not in ranks:  # with local synchronization a non-member calls it on its own: PyTorch returns None
        return None if use_local_synchronization else NON_GROUP_MEMBER
    return _derived_group(default, ranks, me, name, backend, timeout, group_desc or "undefined", pg_options)


def _derived_group(parent: ProcessGroup, ranks: list[int], me: int, name: str, backend: str | None,
                   timeout: timedelta | None, desc: str, pg_options=None) -> ProcessGroup:
    """Build and register a group made from ``parent``, whose backend it inherits; no ``timeout``
    means ``default_pg_timeout``, not the parent's, as in PyTorch."""
    if backend is None:
        backend = None if parent.name() == DEFAULT_CPU_BACKEND else parent.name()
    pg = build_group(
        ranks=ranks,
        my_global_rank=me,
        backend=backend,
        timeout=as_timedelta(timeout) if timeout is not None else default_pg_timeout,
        group_name=name,
        group_desc=desc,
        pg_options=pg_options,
    )
    WORLD.register(pg)
    return pg


def new_subgroups_by_enumeration(
    ranks_per_subgroup_list: list[list[int]],
    timeout: timedelta | None = None,
    backend: str | None = None,
    pg_options=None,
    group_desc: str | None = None,
) -> tuple[ProcessGroup | None, list[ProcessGroup]]:
    """One group per list of ranks; returns (the group holding this rank, all groups)."""
    if not ranks_per_subgroup_list:
        raise ValueError("The arg 'ranks_per_subgroup_list' cannot be empty")
    world_size = WORLD.require_default().size()
    owner: dict[int, int] = {}
    for index, ranks in enumerate(ranks_per_subgroup_list):
        for r in ranks:
            if not 0 <= r < world_size:
                raise ValueError(f"Rank {r} of subgroup {index} is out of range for world size {world_size}")
            if r in owner:
                raise ValueError(f"Rank {r} has appeared in both subgroup {owner[r]} and {index}")
            owner[r] = index
    mine = None
    subgroups = []
    me = WORLD.require_default().rank()
    for index, ranks in enumerate(ranks_per_subgroup_list):
        pg = new_group(ranks, timeout=timeout, backend=backend, pg_options=pg_options, group_desc=group_desc)
        subgroups.append(pg)
        if me in ranks:
            mine = pg
    return mine, subgroups


def new_subgroups(
    group_size: int | None = None,
    group: ProcessGroup | None = None,
    timeout: timedelta | None = None,
    backend: str | None = None,
    pg_options=None,
    group_desc: str | None = None,
) -> tuple[ProcessGroup | None, list[ProcessGroup]]:
    """Split ``group`` (default: WORLD) into consecutive blocks of ``group_size`` ranks."""
    if group_size is None:
        raise ValueError(
            "new_subgroups: group_size defaults to the number of GPUs per node, and torchdist runs on "
            "CPU; pass group_size explicitly"
        )
    if group_size <= 0:
        raise ValueError(f"The arg 'group_size' ({group_size}) must be positive")
    ranks = get_process_group_ranks(group)
    if len(ranks) < group_size:
        raise ValueError(f"The arg 'group_size' ({group_size}) must not exceed the world size ({len(ranks)})")
    if len(ranks) % group_size:
        raise ValueError(f"The world size ({len(ranks)}) must be divisible by 'group_size={group_size}'")
    blocks = [ranks[i : i + group_size] for i in range(0, len(ranks), group_size)]
    return new_subgroups_by_enumeration(blocks, timeout=timeout, backend=backend, pg_options=pg_options,
                                        group_desc=group_desc)


def split_group(
    parent_pg: ProcessGroup | None = None,
    split_ranks: list[list[int]] | None = None,
    timeout: timedelta | None = None,
    pg_options=None,
    group_desc: str | None = None,
    backend: str | None = None,
) -> ProcessGroup | None:
    """Split ``parent_pg`` into disjoint groups; every parent member calls it.

    ``split_ranks`` holds ranks *in the parent group*, as in PyTorch. Returns the
    group holding this rank, or None when no split names it.
    """
    check_timeout(timeout)
    parent = WORLD.resolve(parent_pg)
    if parent is NON_GROUP_MEMBER:
        return None
    if not split_ranks:
        raise ValueError("split_ranks cannot be None or empty")
    seen: set[int] = set()
    for ranks in split_ranks:
        if not ranks:
            raise ValueError(f"split_group: the split group cannot be empty: {split_ranks}")
        for r in ranks:
            if not isinstance(r, int) or not 0 <= r < parent.size():
                raise ValueError(f"split_group: {r!r} is not a rank of the parent group, whose ranks are "
                                 f"0..{parent.size() - 1} (split_ranks holds group ranks of the parent)")
            if r in seen:
                raise ValueError(f"split_group: rank {r} appears twice in split_ranks {split_ranks}")
            seen.add(r)
    split = next((sorted(r) for r in split_ranks if parent.rank() in r), None)
    if split is None:
        return None
    mine = [parent.global_ranks[r] for r in split]
    me = parent.global_ranks[parent.rank()]
    # Only this split's members name it, so the name comes from its member list.
    name = WORLD.next_group_name(mine, use_local_synchronization=True)
    return _derived_group(parent, mine, me, name, backend, timeout, group_desc or f"split of {parent.group_name}",
                          pg_options)


def get_process_group_ranks(group: ProcessGroup | None) -> list[int]:
    """The global ranks of ``group``'s members, in group-rank order."""
    pg = WORLD.resolve(group)
    if pg is NON_GROUP_MEMBER:
        raise ValueError("Invalid process group specified: this rank is not a member")
    return pg.global_ranks


def _registered(group: ProcessGroup, op: str) -> ProcessGroup:
    """``group`` itself (not None: these functions take a group, as PyTorch's do)."""
    if group is None or group is NON_GROUP_MEMBER:
        raise ValueError(f"{op}: Group {group} is not registered, please create group with the new_group API")
    return WORLD.resolve(group)


def get_group_rank(group: ProcessGroup, global_rank: int) -> int:
    """``global_rank``'s rank in ``group``; on the default group, the same number."""
    if group is not None and group is WORLD.default_pg:
        return global_rank
    return WORLD.group_rank(_registered(group, "get_group_rank"), global_rank)


def get_global_rank(group: ProcessGroup, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group``; on the default group, the same number."""
    if group is not None and group is WORLD.default_pg:
        return group_rank
    return WORLD.global_rank(_registered(group, "get_global_rank"), group_rank)


def get_pg_count() -> int:
    """How many process groups this job has created: the default group and every group all
    ranks created together (PyTorch's count, which groups made by their members alone skip)."""
    return 0 if WORLD.default_pg is None else 1 + WORLD.group_count
