"""The action IR as data: checking a schedule, lowering it to explicit communication, and its CSV and table forms.

A schedule is ``{rank: [action or None, ...]}`` (``_plans._Action``; None is an
idle slot). It comes in two forms:

* compute only: F, B, I, W and OVERLAP_F_B actions; the executor of a
  ``PipelineScheduleMulti`` receives and sends around them implicitly.
* compute + comms: what ``_PipelineScheduleRuntime`` runs. The lowering of a
  compute-only schedule is PyTorch 2.13's, pass by pass:

  1. ``add_unshard_reshard`` (per rank): before each compute action, UNSHARD
     the next ``max_active_stages`` stages about to compute and RESHARD the
     active ones that are not among them (FSDP prefetching); RESHARD all at
     the end. None slots are dropped here.
  2. ``add_reduce_grad`` (per rank): a REDUCE_GRAD right after a stage's
     last B or W (its ``n_microbatches``-th).
  3. ``add_send_recv`` (all ranks together): walks the ranks round-robin and
     places a compute action once its input is there (its RECV_F/RECV_B is
     placed, or the neighbouring stage ran on this rank). Right after an F
     whose next stage is on another rank come its SEND_F here and the RECV_F
     on the receiver; likewise SEND_B/RECV_B after a B or I. A receiver's RECV
     is thus always placed after the sender's compute, so the lowered
     schedule cannot wait in a cycle if the compute-only one could not.

  ``merge_bw`` (an I directly followed by its W becomes a B) is PyTorch's
  optional pass; it is not part of the default lowering.

On disk (``write_csv``/``read_csv``) a schedule is one CSV row per rank, one
action per cell, an idle slot an empty cell; the same files PyTorch writes.
"""

from __future__ import annotations

import csv
import itertools
import logging
from collections import defaultdict
from typing import Callable

from ._plans import (B, F, I, RECV_B, RECV_F, REDUCE_GRAD, RESHARD, SEND_B, SEND_F, UNSHARD, W,
                     _Action)

__all__ = ["format_pipeline_order", "validate_schedule", "add_unshard_reshard", "add_reduce_grad", "merge_bw",
           "add_send_recv", "simulate_comms_compute", "read_csv", "write_csv"]

logger = logging.getLogger(__name__)

Schedule = dict[int, list["_Action | None"]]


def _leaves(action: _Action) -> tuple[_Action, ...]:
    """An OVERLAP_F_B's sub-actions, or the action itself."""
    return action.sub_actions if action.sub_actions is not None else (action,)


# -- text ---------------------------------------------------------------------------------------------------------
def format_pipeline_order(pipeline_order: Schedule, error_step_number: int | None = None) -> str:
    """The schedule as a table, one row per step and one column per rank, as PyTorch prints it (its column widths
    included); ``error_step_number`` marks a row with ``<-- ERROR HERE``."""
    ranks = sorted(pipeline_order)
    columns = [["" if a is None else str(a) for a in pipeline_order[r]] for r in ranks]
    num_steps = max(len(c) for c in columns)
    labels = ["Step " + str(i).zfill(len(str(num_steps - 1))) for i in range(num_steps)]
    rows = list(itertools.zip_longest(*columns, fillvalue=""))
    # PyTorch sizes rank column i by its actions and by the label of step i
    widths = [max(len(x) for x in (labels[i], *columns[i], *([""] if len(columns[i]) < num_steps else [])))
              for i in range(min(num_steps, len(ranks)))]
    header = " " * (len(labels[0]) + 2) + " ".join(f"{'Rank ' + str(i):<{widths[i]}}" for i in range(len(ranks)))
    lines = [f"{label}: " + " ".join(f"{item:<{widths[i]}}" for i, item in enumerate(row))
             + (" <-- ERROR HERE" if error_step_number is not None and step == error_step_number else "")
             for step, (label, row) in enumerate(zip(labels, rows))]
    return header + "\n" + "\n".join(lines) + "\n"


def write_csv(filename: str, schedule: Schedule) -> None:
    with open(filename, "w", newline="") as f:
        writer = csv.writer(f)
        for rank in schedule:
            writer.writerow(schedule[rank])


def read_csv(filename: str) -> Schedule:
    with open(filename, newline="") as f:
        return {rank: [_Action.from_str(cell) for cell in row] for rank, row in enumerate(csv.reader(f))}


# -- checking -----------------------------------------------------------------------------------------------------
def validate_schedule(actions: Schedule, pp_group_size: int, num_stages: int, num_microbatches: int) -> dict[int, int]:
    """Check that every stage runs F of each microbatch, then B (or I, then W), that a stage stays on one rank;
    return the stage -> rank mapping the schedule implies. Raises AssertionError with PyTorch's messages."""
    if len(actions) != pp_group_size:
        raise AssertionError(
            f"Schedule has incorrect number of ranks - expected {pp_group_size}, actual {len(actions)}")
    for rank in range(pp_group_size):
        if rank not in actions:
            raise AssertionError(f"Schedule is missing actions for rank {rank}")
    seen = {s: {F: set(), B: set(), I: set(), W: set()} for s in range(num_stages)}
    needs = {B: (F, "Full Backward", "Forward"), I: (F, "Backward Input", "Forward"),
             W: (I, "Backward Weight", "Backward Input")}
    placement: dict[int, int] = {}

    def check(action: _Action, rank: int, step: int) -> None:
        s, kind, mb = action.stage_index, action.computation_type, action.microbatch_index
        if kind in needs:
            before, name, before_name = needs[kind]
            if mb not in seen[s][before]:
                raise AssertionError(
                    f"Rank {rank}, step {step}: Running {name} for stage {s}, microbatch {mb} without first running "
                    f"{before_name}\n\nFull pipeline schedule:\n{format_pipeline_order(actions, step)}")
        if kind in (F, B, I, W):
            seen[s][kind].add(mb)
        if placement.setdefault(s, rank) != rank:
            raise AssertionError(
                f"Rank {rank}, step {step}: Stage {s} is assigned to both rank {rank} and rank {placement[s]}")

    for rank in actions:
        for step, action in enumerate(actions[rank]):
            if action is None:
                continue
            if not isinstance(action, _Action):
                raise AssertionError(
                    f"Rank {rank}, step {step}: Got an invalid action: {action}, expected instance of _Action")
            for leaf in _leaves(action):
                check(leaf, rank, step)
    for s, done in seen.items():
        f, b, i, w = (len(done[k]) for k in (F, B, I, W))
        if f != num_microbatches:
            raise AssertionError(f"Got {f} {F} microbatches for stage {s}, expected {num_microbatches}")
        pad = " " * 12  # PyTorch's messages continue a line inside the string
        if i != w:
            raise AssertionError(f"Invalid backward microbatches for stage {s}: I and W must have equal counts, "
                                 f"{pad}but got I={i}, W={w}")
        if b + (i + w) // 2 != num_microbatches:
            raise AssertionError(f"Invalid backward microbatches for stage {s}: expected {num_microbatches} total "
                                 f"backwards, {pad}but got B={b}, I={i}, W={w}")
    return placement


def check_compute_only(actions: Schedule) -> None:
    for rank, row in actions.items():
        for i, action in enumerate(row):
            if action is not None and not action.is_compute_op:
                raise ValueError(
                    f"Expected compute-only schedule but found communication action '{action}' at rank {rank}, "
                    f"position {i}. Communication actions (e.g. SEND_F, RECV_F, etc.) should not be present when "
                    "format='compute_only'.")


# -- lowering -----------------------------------------------------------------------------------------------------
def add_unshard_reshard(actions: list[_Action | None], max_active_stages: int = 3) -> list[_Action]:
    """Pass 1: UNSHARD each stage before it computes (prefetching the next ``max_active_stages`` stages), RESHARD
    the ones no longer among them. Drops None slots."""
    active: set[int] = set()  # a set, as in PyTorch: its iteration order decides the order of the RESHARDs
    out: list[_Action] = []
    for i, action in enumerate(actions):
        if action is None:
            continue
        upcoming: list[int] = []
        for later in actions[i:]:
            if later is None:
                continue
            for leaf in _leaves(later):
                if leaf.stage_index not in upcoming:
                    upcoming.append(leaf.stage_index)
            if len(upcoming) >= max_active_stages:
                break
        fetch = [s for s in upcoming if s not in active]
        for stage in [s for s in active if s not in upcoming]:
            active.remove(stage)
            out.append(_Action(stage, RESHARD, None))
        for stage in fetch:
            active.add(stage)
            out.append(_Action(stage, UNSHARD, None))
        out.append(action)
    out.extend(_Action(stage, RESHARD, None) for stage in list(active))
    return out


def add_reduce_grad(actions: list[_Action | None], n_microbatches: int) -> list[_Action]:
    """Pass 2: REDUCE_GRAD of a stage right after its ``n_microbatches``-th B or W. Drops None slots."""
    backwards: dict[int, int] = defaultdict(int)
    out: list[_Action] = []
    for action in actions:
        if action is None:
            continue
        out.append(action)
        for leaf in _leaves(action):
            if leaf.computation_type in (B, W):
                backwards[leaf.stage_index] += 1
                if backwards[leaf.stage_index] == n_microbatches:
                    out.append(_Action(leaf.stage_index, REDUCE_GRAD, None))
    return out


def merge_bw(actions: list[_Action | None]) -> list[_Action]:
    """An I directly followed (None slots skipped) by the W of the same stage and microbatch becomes one B."""
    rest = [a for a in actions if a is not None]
    out: list[_Action] = []
    while rest:
        action = rest.pop(0)
        after = rest[0] if rest else None
        if (action.computation_type is I and after is not None and after.computation_type is W
                and (after.stage_index, after.microbatch_index) == (action.stage_index, action.microbatch_index)):
            out.append(_Action(action.stage_index, B, action.microbatch_index))
            rest.pop(0)
        else:
            out.append(action)
    return out


def add_send_recv(compute_actions: Schedule, stage_to_rank: Callable[[int], int], num_stages: int) -> Schedule:
    """Pass 3: explicit SEND/RECV actions (see the module docstring). Raises AssertionError if no rank can place
    its next action (the compute-only schedule waits on itself)."""
    todo = {rank: list(row) for rank, row in compute_actions.items() if row}
    out: Schedule = {rank: [] for rank in compute_actions}
    placed: dict[int, set[_Action]] = {rank: set() for rank in compute_actions}

    def crosses(a: _Action) -> bool:
        """Does the result of ``a`` go to a stage on another rank?"""
        if a.computation_type is F:
            return a.stage_index != num_stages - 1 and stage_to_rank(a.stage_index + 1) != stage_to_rank(a.stage_index)
        if a.computation_type in (I, B):
            return a.stage_index != 0 and stage_to_rank(a.stage_index - 1) != stage_to_rank(a.stage_index)
        return False

    def ready(a: _Action, done: set[_Action]) -> bool:
        s, kind, mb = a.stage_index, a.computation_type, a.microbatch_index
        if kind is F and s != 0:
            return _Action(s, RECV_F, mb) in done or _Action(s - 1, F, mb) in done
        if kind in (I, B) and s != num_stages - 1:
            return any(x in done for x in (_Action(s, RECV_B, mb), _Action(s + 1, I, mb), _Action(s + 1, B, mb)))
        return True

    while todo:
        progress = False
        for rank in sorted(todo):
            action = todo[rank][0]
            leaves = _leaves(action) if action is not None else ()
            if not all(ready(a, placed[rank]) for a in leaves):
                continue
            if action is not None:
                out[rank].append(action)
                for a in leaves:
                    placed[rank].add(a)
                    if crosses(a):
                        forward = a.computation_type is F
                        send = _Action(a.stage_index, SEND_F if forward else SEND_B, a.microbatch_index)
                        recv = _Action(a.stage_index + (1 if forward else -1), RECV_F if forward else RECV_B,
                                       a.microbatch_index)
                        out[rank].append(send)
                        placed[rank].add(send)
                        peer = stage_to_rank(recv.stage_index)
                        out[peer].append(recv)
                        placed[peer].add(recv)
            todo[rank].pop(0)
            if not todo[rank]:
                del todo[rank]
            progress = True
        if not progress:
            raise AssertionError("Malformed compute schedule, can't schedule sends/recvs")
    return out


def simulate_comms_compute(pipeline_order: Schedule, stage_to_rank: Callable[[int], int],
                           num_stages: int) -> dict[int, list[_Action | None]]:
    """Run a compute + comms schedule on all ranks in unit steps (a rank idles, None, while its next action's
    input is missing); return the timeline. Raises ValueError("Schedule is not progressing") on a deadlock."""
    todo = {rank: [a for a in pipeline_order[rank] if a is not None] for rank in sorted(pipeline_order)}
    timeline: dict[int, list[_Action | None]] = {rank: [] for rank in todo}
    done: dict[int, set[_Action]] = {rank: set() for rank in todo}

    def ready(a: _Action) -> bool:
        if a.sub_actions is not None:  # an OVERLAP_F_B (PyTorch's simulator fails on it)
            return all(ready(sub) for sub in a.sub_actions)
        s, kind, mb = a.stage_index, a.computation_type, a.microbatch_index
        mine = done[stage_to_rank(s)]
        if kind is F:
            return s == 0 or _Action(s, RECV_F, mb) in mine or _Action(s - 1, F, mb) in mine
        if kind in (I, B):
            return (s == num_stages - 1 or _Action(s, RECV_B, mb) in mine or _Action(s + 1, I, mb) in mine
                    or _Action(s + 1, B, mb) in mine)
        if kind is W:
            return True
        if kind is SEND_F:
            return _Action(s, F, mb) in mine
        if kind is RECV_F:
            return _Action(s - 1, SEND_F, mb) in done[stage_to_rank(s - 1)]
        if kind is SEND_B:
            return _Action(s, I, mb) in mine or _Action(s, B, mb) in mine
        if kind is RECV_B:
            return _Action(s + 1, SEND_B, mb) in done[stage_to_rank(s + 1)]
        raise ValueError(f"Unsupported action type {a}")

    def drop_finished() -> None:
        for rank in [r for r in todo if not todo[r]]:
            del todo[rank]

    while todo:
        progress = False
        for rank in sorted(todo):
            if todo[rank] and ready(todo[rank][0]):
                action = todo[rank].pop(0)
                timeline[rank].append(action)
                done[rank].update(_leaves(action))
                progress = True
            elif todo[rank]:
                timeline[rank].append(None)
        drop_finished()
        # a rank that idled this step may use it after all, if a later rank unblocked it (PyTorch's second pass)
        for rank in sorted(todo):
            if timeline[rank][-1] is None and ready(todo[rank][0]):
                action = todo[rank].pop(0)
                timeline[rank][-1] = action
                done[rank].update(_leaves(action))
        drop_finished()
        if not progress:
            logger.error("WIP comms schedule:\n%s next actions: %s", format_pipeline_order(timeline),
                         {rank: todo[rank][0] for rank in todo})
            raise ValueError("Schedule is not progressing")
    return timeline

