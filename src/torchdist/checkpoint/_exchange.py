"""The collective steps of a save or load, with failures reported on every rank instead of hanging.

Each step runs a local function on every rank and catches what it raises;
the results (or errors) meet at the coordinator (group rank 0), which runs
the global function only if no rank failed, and sends each rank its share.
If any rank failed, every rank raises one ``CheckpointException`` listing
each failed rank's exception, so a missing key on rank 2 is reported on rank
0 as well, and no rank is left waiting in a later step.

    reduce_scatter: local(rank) -> gather -> global(all) on coordinator -> scatter one result to each rank
    all_reduce:     local(rank) -> gather -> global(all) on coordinator -> broadcast one result
    all_gather:     local(rank) -> all_gather -> every rank sees every result
    broadcast:      fn() on coordinator -> broadcast

Without a process group (``no_dist``) the same steps run in this process alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from .._c10d.groups import get_global_rank
from .._c10d.init import get_rank, get_world_size
from .._c10d.object_collectives import (all_gather_object, broadcast_object_list, gather_object,
                                        scatter_object_list)
from .api import CheckpointException, _is_wrapped_exception, _wrap_exception

T = TypeVar("T")
R = TypeVar("R")


class Exchange:
    """One rank's view of a save/load: its rank, whether it coordinates, and the guarded collective steps."""

    def __init__(self, group: Any, use_dist: bool, coordinator_rank: int = 0):
        self.group = group
        self.use_dist = use_dist
        self.coordinator_rank = coordinator_rank
        if use_dist:
            self.rank = get_rank(group)
            self.world_size = get_world_size(group)
            self.coordinator_global = coordinator_rank if group is None else get_global_rank(group, coordinator_rank)
        else:
            self.rank, self.world_size, self.coordinator_global = 0, 1, 0
        self.is_coordinator = self.rank == coordinator_rank

    # -- the primitive moves of objects (only called with use_dist) --
    def _gather(self, obj: Any) -> list[Any] | None:
        out = [None] * self.world_size if self.is_coordinator else None
        gather_object(obj, out, dst=self.coordinator_global, group=self.group)
        return out

    def _scatter(self, objs: list[Any] | None) -> Any:
        out = [None]
        scatter_object_list(out, objs, src=self.coordinator_global, group=self.group)
        return out[0]

    def _broadcast(self, obj: Any) -> Any:
        box = [obj]
        broadcast_object_list(box, src=self.coordinator_global, group=self.group)
        return box[0]

    # -- the steps --
    @staticmethod
    def _attempt(fn: Callable[..., T], *args: Any) -> T | tuple:
        try:
            return fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported to every rank below
            return _wrap_exception(exc)

    @staticmethod
    def _failures(results: list[Any]) -> dict[int, tuple]:
        return {rank: r for rank, r in enumerate(results) if _is_wrapped_exception(r)}

    @staticmethod
    def _raise_if_failed(result: Any) -> Any:
        if isinstance(result, CheckpointException):
            raise result
        return result

    def reduce_scatter(self, step: str, local: Callable[[], T], global_: Callable[[list[T]], list[R]]) -> R:
        """Every rank's ``local()`` to the coordinator; each rank gets its entry of ``global_(all)``."""
        mine = self._attempt(local)
        if not self.use_dist:
            all_results = [mine]
        else:
            all_results = self._gather(mine)
        shares: list[Any] | None = None
        if self.is_coordinator:
            failures = self._failures(all_results)
            if not failures:
                shares = self._attempt(global_, all_results)
                if _is_wrapped_exception(shares):
                    failures = {self.rank: shares}
            if failures:
                shares = [CheckpointException(step, failures)] * self.world_size
        result = shares[0] if not self.use_dist else self._scatter(shares)
        return self._raise_if_failed(result)

    def all_reduce(self, step: str, local: Callable[[], T], global_: Callable[[list[T]], R]) -> R:
        """Every rank's ``local()`` to the coordinator; every rank gets ``global_(all)``."""
        mine = self._attempt(local)
        all_results = [mine] if not self.use_dist else self._gather(mine)
        result: Any = None
        if self.is_coordinator:
            failures = self._failures(all_results)
            if not failures:
                result = self._attempt(global_, all_results)
                if _is_wrapped_exception(result):
                    failures = {self.rank: result}
            if failures:
                result = CheckpointException(step, failures)
        if self.use_dist:
            result = self._broadcast(result)
        return self._raise_if_failed(result)

    def all_gather(self, step: str, local: Callable[[], T]) -> list[T]:
        """Every rank's ``local()``, on every rank."""
        mine = self._attempt(local)
        if self.use_dist:
            everyone: list[Any] = [None] * self.world_size
            all_gather_object(everyone, mine, group=self.group)
        else:
            everyone = [mine]
        failures = self._failures(everyone)
        if failures:
            raise CheckpointException(step, failures)
        return everyone

    def broadcast(self, step: str, fn: Callable[[], T]) -> T:
        """The coordinator's ``fn()``, on every rank."""
        result: Any = None
        if self.is_coordinator:
            result = self._attempt(fn)
            if _is_wrapped_exception(result):
                result = CheckpointException(step, {self.rank: result})
        if self.use_dist:
            result = self._broadcast(result)
        return self._raise_if_failed(result)
