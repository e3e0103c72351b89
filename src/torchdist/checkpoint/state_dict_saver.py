"""``save`` and ``async_save``: every rank writes its share of the state_dict, the coordinator the metadata.

Steps (``_exchange.py`` runs them): "plan" -- each rank's planner proposes
its items and the writer readies its directory; the coordinator deduplicates,
builds the metadata and names each rank's files; each rank gets its plan back.
"write" -- each rank writes its items; the coordinator, once all succeeded,
writes ``.metadata`` and every rank returns it. ``async_save`` first stages
the state_dict (``staging.py``: CPU copies) and runs these steps on the copy
in a background thread.
"""

from __future__ import annotations

import inspect
import os
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Any

from .._c10d.init import get_rank
from ._exchange import Exchange
from ._storage_utils import resolve_no_dist, storage_setup
from .default_planner import DefaultSavePlanner
from .metadata import Metadata
from .planner import SavePlan, SavePlanner
from .staging import AsyncStager, DefaultStager, StagingOptions
from .stateful import Stateful
from .storage import StorageWriter

__all__ = ["save", "async_save", "save_state_dict", "AsyncCheckpointerType", "AsyncSaveResponse"]


class AsyncCheckpointerType(Enum):
    """Where ``async_save`` writes; torchdist writes from a background thread for both."""

    THREAD = "thread"
    PROCESS = "process"


def _stateful_to_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy in which each Stateful value is replaced by its ``state_dict()``."""
    return {key: value.state_dict() if isinstance(value, Stateful) else value for key, value in state_dict.items()}


def _accepts_kwargs(fn) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())


def save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
         storage_writer: StorageWriter | None = None, planner: SavePlanner | None = None,
         process_group: Any = None, no_dist: bool = False, use_collectives: bool = True) -> Metadata:
    """Save ``state_dict`` (nested dicts/lists of tensors, DTensors and picklable values) as one checkpoint.

    Every rank of ``process_group`` must call it. Replicated values are written
    once; sharded ones as the chunks each rank holds. Returns the metadata.
    With ``use_collectives=False`` each rank writes a checkpoint of its own
    values, with its own ``__{rank}.metadata``, without talking to the others.
    """
    no_dist = resolve_no_dist(no_dist, "save")
    writer = storage_setup(storage_writer, checkpoint_id, reader=False)
    return _save_state_dict(_stateful_to_state_dict(state_dict), writer, process_group, no_dist=no_dist,
                            planner=planner, use_collectives=use_collectives)


def save_state_dict(state_dict: dict[str, Any], storage_writer: StorageWriter, process_group: Any = None,
                    coordinator_rank: int = 0, no_dist: bool = False, planner: SavePlanner | None = None) -> Metadata:
    """Deprecated spelling of ``save`` (PyTorch keeps it too)."""
    warnings.warn("'save_state_dict' is deprecated and will be removed in future versions. Please use 'save' "
                  "instead.", FutureWarning, stacklevel=2)
    storage_writer.reset()
    return _save_state_dict(state_dict, storage_writer, process_group, coordinator_rank, no_dist, planner)


def _save_state_dict(state_dict: dict[str, Any], storage_writer: StorageWriter, process_group: Any = None,
                     coordinator_rank: int = 0, no_dist: bool = False, planner: SavePlanner | None = None,
                     use_collectives: bool = True) -> Metadata:
    local_only = not no_dist and not use_collectives
    exchange = Exchange(process_group, use_dist=not no_dist and use_collectives, coordinator_rank=coordinator_rank)
    rank = get_rank(process_group) if local_only else exchange.rank
    planner = planner if planner is not None else DefaultSavePlanner()
    global_metadata: Metadata | None = None

    def local_step() -> SavePlan:
        planner.set_up_planner(state_dict, storage_writer.storage_meta(), exchange.is_coordinator)
        if _accepts_kwargs(storage_writer.set_up_storage_writer):
            storage_writer.set_up_storage_writer(exchange.is_coordinator, rank=rank, use_collectives=use_collectives)
        else:
            storage_writer.set_up_storage_writer(exchange.is_coordinator)
        return storage_writer.prepare_local_plan(planner.create_local_plan())

    def global_step(all_plans: list[SavePlan]) -> list[SavePlan]:
        nonlocal global_metadata
        all_plans, global_metadata = planner.create_global_plan(all_plans)
        return all_plans if local_only else storage_writer.prepare_global_plan(all_plans)

    central_plan = exchange.reduce_scatter("plan", local_step, global_step)

    def write_step():
        final_plan = planner.finish_plan(central_plan)
        return storage_writer.write_data(final_plan, planner).wait()

    def finish_step(all_results) -> Metadata:
        storage_writer.finish(metadata=global_metadata, results=all_results)
        return global_metadata

    return exchange.all_reduce("write", write_step, finish_step)


@dataclass
class AsyncSaveResponse:
    """What ``async_save`` returns when the stager stages in the background: one future per phase."""

    staging_completion: Future[None]  # done once the copy is made: the caller may change its tensors
    upload_completion: Future[Metadata]  # done once the checkpoint is written


def _save_staged(staged: Future[dict[str, Any]] | dict[str, Any], writer: StorageWriter, process_group: Any,
                 no_dist: bool, planner: SavePlanner | None, use_collectives: bool) -> Metadata:
    """The background save: wait for the staged copy if it is still being made, then save it."""
    state_dict = staged.result() if isinstance(staged, Future) else staged
    return _save_state_dict(state_dict, writer, process_group, no_dist=no_dist, planner=planner,
                            use_collectives=use_collectives)


def _staging_done(staging: Future[dict[str, Any]]) -> Future[None]:
    """A future that ends as ``staging`` does, without its value (PyTorch's ``staging_completion``)."""
    done: Future[None] = Future()

    def forward(finished: Future[dict[str, Any]]) -> None:
        error = finished.exception()
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(None)

    staging.add_done_callback(forward)  # runs at once if staging is already done
    return done


def async_save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
               storage_writer: StorageWriter | None = None, planner: SavePlanner | None = None,
               process_group: Any = None, async_checkpointer_type: AsyncCheckpointerType = AsyncCheckpointerType.THREAD,
               async_stager: AsyncStager | None = None, no_dist: bool = False,
               use_collectives: bool = True) -> Future | AsyncSaveResponse:
    """Stage the state_dict (CPU copies), then save the copy in a background thread.

    Returns the save's Future (its result is the Metadata), or, when the stager stages in the background
    (``DefaultStager`` with ``use_async_staging``), an ``AsyncSaveResponse`` with a future for each phase.
    Without ``async_stager``, a ``storage_writer`` that is an ``AsyncStager`` stages, else a synchronous
    ``DefaultStager``. The caller keeps and closes a stager it passes. The background thread runs the save's
    collectives on ``process_group``: as with PyTorch, wait for the future before this rank issues other
    collectives on that group, or give the save a group of its own (``torchdist.new_group()``).
    """
    if async_checkpointer_type == AsyncCheckpointerType.PROCESS:
        # PyTorch hands the staged copy to a writer process with a process group of its own; the files and the
        # Future's result are the same when a thread writes them, which is all torchdist offers.
        warnings.warn("async_save: torchdist writes in a background thread; AsyncCheckpointerType.PROCESS runs "
                      "as THREAD (the same files and result)", stacklevel=2)
    no_dist = resolve_no_dist(no_dist, "save")
    writer = storage_setup(storage_writer, checkpoint_id, reader=False)
    owned = None
    if async_stager is None:
        if storage_writer is not None and isinstance(storage_writer, AsyncStager):
            async_stager = storage_writer  # PyTorch's older writers stage themselves
        else:
            async_stager = owned = DefaultStager(StagingOptions(False, False, False, False))
    try:
        staged = async_stager.stage(_stateful_to_state_dict(state_dict))
    finally:
        if owned is not None:
            owned.close()  # synchronous: nothing is left to wait for
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="AsyncCheckpointExecutor")
    upload = executor.submit(_save_staged, staged, writer, process_group, no_dist, planner, use_collectives)
    upload.add_done_callback(lambda _: executor.shutdown(wait=False))
    if isinstance(staged, Future):
        return AsyncSaveResponse(staging_completion=_staging_done(staged), upload_completion=upload)
    if async_stager.should_synchronize_after_execute:
        async_stager.synchronize_staging()
    return upload
