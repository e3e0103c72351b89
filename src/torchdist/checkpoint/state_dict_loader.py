"""``load``: fill a state_dict in place from a checkpoint saved at any world size and sharding.

Steps (``_exchange.py`` runs them): "plan" -- each rank reads ``.metadata``
and its planner lists, for every chunk it holds, the overlapping boxes of
the saved chunks (a key missing from the checkpoint or a shape that differs
fails here, on the rank concerned, and every rank raises). "read" -- each rank
reads its boxes from the data files and copies them into its tensors.
"""

from __future__ import annotations

import inspect
import os
import warnings
from typing import Any

from .._c10d.init import get_rank
from ._exchange import Exchange
from ._storage_utils import resolve_no_dist, storage_setup
from .default_planner import DefaultLoadPlanner
from .metadata import Metadata
from .planner import LoadPlan, LoadPlanner
from .stateful import Stateful
from .storage import StorageReader

__all__ = ["load", "load_state_dict"]


def load(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
         storage_reader: StorageReader | None = None, planner: LoadPlanner | None = None,
         process_group: Any = None, no_dist: bool = False) -> None:
    """Load the checkpoint into ``state_dict`` in place: its tensors are copied into, other values replaced.

    The state_dict says what to load and how this rank holds it (plain tensor,
    DTensor with any placements); Stateful values are given their loaded
    ``state_dict`` through ``load_state_dict``. Every rank must call it.
    """
    no_dist = resolve_no_dist(no_dist, "load")
    reader = storage_setup(storage_reader, checkpoint_id, reader=True)
    keys = sorted(state_dict.keys())
    to_load = {key: state_dict[key].state_dict() if isinstance(state_dict[key], Stateful) else state_dict[key]
               for key in keys}
    _load_state_dict(to_load, reader, process_group, no_dist=no_dist, planner=planner)
    for key in keys:
        if isinstance(state_dict[key], Stateful):
            state_dict[key].load_state_dict(to_load[key])
        else:
            state_dict[key] = to_load[key]


def load_state_dict(state_dict: dict[str, Any], storage_reader: StorageReader, process_group: Any = None,
                    coordinator_rank: int = 0, no_dist: bool = False, planner: LoadPlanner | None = None) -> None:
    """Deprecated spelling of ``load`` (PyTorch keeps it too)."""
    warnings.warn("'load_state_dict' is deprecated and will be removed in future versions. Please use 'load' "
                  "instead.", FutureWarning, stacklevel=2)
    storage_reader.reset()
    _load_state_dict(state_dict, storage_reader, process_group, coordinator_rank, no_dist, planner)


class _MetadataNotFound(FileNotFoundError, AssertionError):
    """The checkpoint has no metadata file: PyTorch's AssertionError, and the FileNotFoundError it is."""


def _read_metadata(reader: StorageReader, rank: int) -> tuple[Metadata | None, bool, BaseException | None]:
    """(metadata, collective, error): the global metadata, else this rank's own (a ``use_collectives=False`` save).

    An error is returned, not raised, so that the plan step reports it on every rank instead of leaving the
    ranks that did read the metadata waiting for this one.
    """
    try:
        return reader.read_metadata(), True, None
    except Exception as exc:  # noqa: BLE001 - reported through the plan step
        takes_rank = any(p.kind is inspect.Parameter.VAR_KEYWORD
                         for p in inspect.signature(reader.read_metadata).parameters.values())
        if takes_rank:
            try:
                return reader.read_metadata(rank=rank), False, None
            except Exception:  # noqa: BLE001 - the global metadata's error is the one to report
                pass
        return None, True, exc


def _load_state_dict(state_dict: dict[str, Any], storage_reader: StorageReader, process_group: Any = None,
                     coordinator_rank: int = 0, no_dist: bool = False, planner: LoadPlanner | None = None) -> None:
    rank = 0 if no_dist else get_rank(process_group)
    metadata, collective, error = _read_metadata(storage_reader, rank)
    exchange = Exchange(process_group, use_dist=not no_dist and collective, coordinator_rank=coordinator_rank)
    planner = planner if planner is not None else DefaultLoadPlanner()

    def local_step() -> LoadPlan:
        if error is not None:
            # PyTorch raises AssertionError("metadata is None; ..."); a missing file is also a FileNotFoundError
            kind = _MetadataNotFound if isinstance(error, FileNotFoundError) else AssertionError
            raise kind(f"metadata is None; global metadata read failed on rank {rank}: {error}") from error
        planner.set_up_planner(state_dict, metadata, exchange.is_coordinator)
        storage_reader.set_up_storage_reader(metadata, exchange.is_coordinator)
        return storage_reader.prepare_local_plan(planner.create_local_plan())

    def global_step(all_plans: list[LoadPlan]) -> list[LoadPlan]:
        return storage_reader.prepare_global_plan(planner.create_global_plan(all_plans))

    central_plan = exchange.reduce_scatter("plan", local_step, global_step)

    def read_step() -> None:
        final_plan = planner.finish_plan(central_plan)
        storage_reader.read_data(final_plan, planner).wait()

    exchange.all_gather("read", read_step)
