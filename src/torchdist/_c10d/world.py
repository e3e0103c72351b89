"""The ``World``: every process group this process belongs to, in one object.

PyTorch keeps this state in module-level registries spread over a 6,900-line file;
torchdist keeps it in one :class:`World` instance (``WORLD``) with the operations
that read it: resolve ``group=None`` to the default group, map global ranks to group
ranks and back, name new groups.

Non-members: ``new_group`` returns ``GroupMember.NON_GROUP_MEMBER`` on ranks outside
the group, and every API that receives it behaves as PyTorch does (queries return
-1, collectives warn and return None).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from .._process_group.process_group import ProcessGroup
from .._store.base import Store

__all__ = ["World", "WORLD", "GroupMember", "group", "NON_GROUP_MEMBER"]


class _NonGroupMember(int):
    """What ``new_group`` returns on ranks that are not in the group: -100, as PyTorch's
    ``GroupMember.NON_GROUP_MEMBER``, so code that compares with -100 works; an object of its
    own, so torchdist tells it apart by identity."""

    def __repr__(self) -> str:
        return "GroupMember.NON_GROUP_MEMBER"

    def __reduce__(self) -> str:
        return "NON_GROUP_MEMBER"


NON_GROUP_MEMBER = _NonGroupMember(-100)


@dataclass
class World:
    """The default group, every other group, and the store they were built from."""

    default_pg: ProcessGroup | None = None
    store: Store | None = None
    # True when init_process_group made the store (rendezvous) rather than the user.
    owns_store: bool = False
    groups: dict[str, ProcessGroup] = field(default_factory=dict)
    # How many groups were created collectively (all ranks call new_group in order).
    group_count: int = 0
    # Groups created with use_local_synchronization, per member list.
    local_group_count: dict[tuple[int, ...], int] = field(default_factory=dict)
    # Where groups' store keys live: "" until shrink_group replaces the default group, then a namespace of
    # the shrunk world's own, so that the survivors' new groups never meet keys of the groups before it.
    store_prefix: str = ""
    # shrink_group calls per parent group name: part of the shrunk group's name (see _c10d/shrink.py).
    shrink_count: dict[str, int] = field(default_factory=dict)

    # -- lookups ---------------------------------------------------------------------
    def require_default(self) -> ProcessGroup:
        if self.default_pg is None:
            raise ValueError(
                "Default process group has not been initialized, please make sure to call init_process_group."
            )
        return self.default_pg

    def resolve(self, group: ProcessGroup | None) -> ProcessGroup | _NonGroupMember:
        """``None`` (and ``group.WORLD``) means the default group; validates the rest."""
        if group is None:
            return self.require_default()
        if group is NON_GROUP_MEMBER:
            return group
        if not isinstance(group, ProcessGroup):
            raise TypeError(f"group must be a ProcessGroup or None, got {type(group).__name__}")
        if self.groups.get(group.group_name) is not group:
            raise ValueError(
                f"process group {group.group_name!r} is not registered: it was destroyed, or created "
                "before the last destroy_process_group()"
            )
        return group

    def group_rank(self, pg: ProcessGroup, global_rank: int) -> int:
        """The rank in ``pg`` of ``global_rank``; ValueError when it is not a member."""
        try:
            return pg.global_ranks.index(global_rank)
        except ValueError:
            raise ValueError(
                f"Global rank {global_rank} is not part of group {pg.group_name!r} "
                f"(members: {pg.global_ranks})"
            ) from None

    def global_rank(self, pg: ProcessGroup, group_rank: int) -> int:
        if not 0 <= group_rank < pg.size():
            raise ValueError(
                f"Group rank {group_rank} is not part of group {pg.group_name!r} of size {pg.size()}"
            )
        return pg.global_ranks[group_rank]

    # -- registration ------------------------------------------------------------------
    def next_group_name(self, ranks: list[int], use_local_synchronization: bool) -> str:
        """A name equal on every member, used as the group's store prefix.

        Collectively created groups are numbered in creation order. Groups created by
        their members alone cannot share a counter with non-members, so they are
        named by a hash of their members plus a per-member-list count.
        """
        if not use_local_synchronization:
            self.group_count += 1
            return str(self.group_count)
        key = tuple(ranks)
        self.local_group_count[key] = self.local_group_count.get(key, 0) + 1
        digest = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:12]
        return f"local-{digest}-{self.local_group_count[key]}"

    def register(self, pg: ProcessGroup) -> None:
        self.groups[pg.group_name] = pg

    def unregister(self, pg: ProcessGroup) -> None:
        self.groups.pop(pg.group_name, None)

    def reset(self) -> None:
        """Forget everything (after destroying every group)."""
        self.default_pg = None
        self.store = None
        self.owns_store = False
        self.groups.clear()
        self.group_count = 0
        self.local_group_count.clear()
        self.store_prefix = ""
        self.shrink_count.clear()


WORLD = World()


class _WorldProperty:
    """A class attribute that reads the current default group, as ``group.WORLD`` does."""

    def __get__(self, obj, owner) -> ProcessGroup | None:
        return WORLD.default_pg


class GroupMember:
    """``GroupMember.WORLD`` is the default group; ``NON_GROUP_MEMBER`` marks outsiders."""

    WORLD = _WorldProperty()
    NON_GROUP_MEMBER = NON_GROUP_MEMBER


class group:  # noqa: N801 - PyTorch's name
    """``group.WORLD``: the default group (None before init_process_group)."""

    WORLD = _WorldProperty()
