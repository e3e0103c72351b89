"""Pipeline schedules: split a batch into microbatches and run each rank's plan of forwards and backwards.

``step(*args, target=..., losses=...)`` is the whole training step of one rank:
the first stage gets the inputs, the last stage the target; the batch is cut
into ``n_microbatches``; the plan from ``_plans`` runs (``_executor``),
receiving what an action needs right before it and sending what it produced
right after (``isend``: a rank never waits for its sends until the end of the
step). The multi-stage schedules are ``_PipelineScheduleRuntime``s, as in
PyTorch: their plan is lowered once to explicit SEND/RECV actions
(``_actions``), which the executor runs as written; a custom plan is loaded
from a CSV file or a dict (``_load_csv``, ``_load_actions``);
losses are collected on the last stage, outputs merged there, and gradients
divided by ``n_microbatches`` when ``scale_grads``. An OVERLAP_F_B action
(DualPipeV) runs its forward, then its backward: on CPU there are no streams
to run them at once, and the result is the same.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, Callable, Literal

import torch

from . import _actions, _plans
from ._actions import add_reduce_grad as _add_reduce_grad
from ._actions import add_send_recv as _add_send_recv
from ._actions import add_unshard_reshard as _add_unshard_reshard
from ._actions import format_pipeline_order as _format_pipeline_order
from ._actions import merge_bw as _merge_bw
from ._actions import simulate_comms_compute as _simulate_comms_compute
from ._actions import validate_schedule as _validate_schedule
from ._executor import Executor
from ._plans import _Action, _ComputationType
from .microbatch import _TARGET_CHUNK_SPEC, TensorChunkSpec, _split_tensor, merge_chunks, split_args_kwargs_into_chunks
from .stage import PipelineStage

__all__ = ["PipelineScheduleSingle", "PipelineScheduleMulti", "ScheduleGPipe", "Schedule1F1B",
           "ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
           "ScheduleDualPipeV", "get_schedule_class", "_Action", "_ComputationType", "_PipelineScheduleRuntime",
           "_format_pipeline_order", "_validate_schedule", "_add_unshard_reshard", "_add_reduce_grad", "_merge_bw",
           "_add_send_recv", "_simulate_comms_compute"]

logger = logging.getLogger(__name__)


class _PipelineSchedule(ABC):
    """What every schedule shares: microbatching, the loss, the step, the executor of a plan."""

    def __init__(
        self,
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
        kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
        output_merge_spec: dict[str, Any] | tuple[Any] | None = None,
        scale_grads: bool = True,
    ) -> None:
        if not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"n_microbatches must be a positive int, got {n_microbatches!r}")
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self.scale_grads = scale_grads
        self._args_chunk_spec = args_chunk_spec
        self._kwargs_chunk_spec = kwargs_chunk_spec
        self._output_merge_spec = output_merge_spec
        self._has_backward = loss_fn is not None
        self._internal_losses: list[torch.Tensor] = []
        self._stages: list[PipelineStage] = []
        self._initialized_for: bool | None = None  # has_backward of the set-up, None before the first step
        self._backward_requires_autograd = True

    # -- the plan of this rank -----------------------------------------------------------------
    @abstractmethod
    def _rank_actions(self) -> list[_Action]:
        """The actions this rank runs, in order."""

    # -- inputs and outputs --------------------------------------------------------------------
    def _check_inputs(self, arg_mbs: list | None = None, kwarg_mbs: list | None = None,
                      target_mbs: list | None = None, losses: list | None = None) -> tuple[list, list]:
        def check(mbs: Any, name: str) -> None:
            if not isinstance(mbs, list):
                raise TypeError(f"{name} must be a list but got a {type(mbs)}")
            if len(mbs) != self._n_microbatches:
                raise ValueError(f"Expecting {self._n_microbatches} {name} but got {len(mbs)}")

        if arg_mbs is not None:
            check(arg_mbs, "arg_mbs")
        else:
            arg_mbs = [()] * self._n_microbatches
        if kwarg_mbs is not None:
            check(kwarg_mbs, "kwarg_mbs")
        else:
            kwarg_mbs = [{}] * self._n_microbatches
        if target_mbs is not None:
            check(target_mbs, "target_mbs")
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"losses must be a list but got a {type(losses)}")
        return arg_mbs, kwarg_mbs

    def _split_inputs(self, args: tuple, kwargs: dict | None = None) -> tuple[list, list]:
        if args or kwargs:
            return split_args_kwargs_into_chunks(args, kwargs, self._n_microbatches, self._args_chunk_spec,
                                                 self._kwargs_chunk_spec)
        return [()] * self._n_microbatches, [{}] * self._n_microbatches  # a middle or last stage

    def _merge_outputs(self, output_chunks: list[Any]) -> Any:
        return merge_chunks(output_chunks, self._output_merge_spec)

    def _compute_loss(self, output: Any, target: Any, loss_kwargs: dict | None = None) -> torch.Tensor:
        return self._loss_fn(output, target, **(loss_kwargs or {}))

    def _update_losses(self, stages: list[PipelineStage], losses: list | None) -> None:
        if any(s.is_last for s in stages) and losses is not None:
            if len(self._internal_losses) != self._n_microbatches:
                raise RuntimeError(
                    f"Expecting {self._n_microbatches} losses but got {len(self._internal_losses)}"
                )
            losses.clear()
            losses.extend(self._internal_losses)
        self._internal_losses.clear()

    # -- the step -------------------------------------------------------------------------------
    def step(self, *args: Any, target: Any = None, losses: list | None = None, return_outputs: bool = True,
             loss_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        """One training step on the whole batch: split, run the plan, merge. Returns the merged output on the
        rank holding the last stage (None elsewhere, or with ``return_outputs=False``)."""
        if self._has_backward and self._backward_requires_autograd and not torch.is_grad_enabled():
            raise RuntimeError(
                "step() requires gradients to be enabled for backward computation; it should not be used under "
                "torch.no_grad() context. Please call eval() instead."
            )
        for stage in self._stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        args_split, kwargs_split = self._split_inputs(args, kwargs)
        targets_split = (list(_split_tensor(target, _TARGET_CHUNK_SPEC, self._n_microbatches))
                         if target is not None else None)
        self._step_microbatches(args_split, kwargs_split, targets_split, losses, return_outputs,
                                loss_kwargs=loss_kwargs)
        for stage in self._stages:
            if stage.is_last and return_outputs:
                return self._merge_outputs(stage.output_chunks)
        return None

    def eval(self, *args: Any, target: Any = None, losses: list | None = None, **kwargs: Any) -> Any:
        """``step`` with forwards only (and losses, when a loss_fn and a target are given)."""
        had_backward = self._has_backward
        try:
            self._has_backward = False
            return self.step(*args, target=target, losses=losses, **kwargs)
        finally:
            self._has_backward = had_backward

    def _initialize(self, args: tuple, kwargs: dict) -> None:
        """Agree with the other stages on the tensors exchanged (first step, or after switching train/eval)."""
        if self._initialized_for == self._has_backward:
            return
        votes: dict[int, Any] = {}
        for stage in self._stages:
            votes[stage.stage_index] = stage._vote_forward(votes.get(stage.stage_index - 1), self._n_microbatches,
                                                           self._has_backward)
        verdicts: dict[int, Any] = {}
        for stage in reversed(self._stages):
            mine = votes[stage.stage_index][0] if stage.is_last else verdicts.get(stage.stage_index + 1)
            verdicts[stage.stage_index] = stage._vote_backward(mine)
        metas: dict[int, Any] = {}
        for stage in self._stages:
            metas[stage.stage_index] = stage._infer_forward_meta(
                metas.get(stage.stage_index - 1), args if stage.is_first else (), kwargs, self._has_backward)
        self._initialized_for = self._has_backward

    def _step_microbatches(self, arg_mbs: list | None = None, kwarg_mbs: list | None = None,
                           target_mbs: list | None = None, losses: list | None = None, return_outputs: bool = True,
                           loss_kwargs: dict[str, Any] | None = None) -> None:
        """Run one step on microbatches already split."""
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        if self._loss_fn is not None and target_mbs is None and any(s.is_last for s in self._stages):
            raise RuntimeError(
                f"{type(self).__name__}.step(): a loss_fn was given but no target; pass target= to step() on the "
                f"rank that holds the last stage (stage {self._stages[0].num_stages - 1})"
            )
        for stage in self._stages:
            stage.chunks = self._n_microbatches
        self._initialize(arg_mbs[0], kwarg_mbs[0])
        explicit = self._explicit_comms()
        Executor(self, arg_mbs, kwarg_mbs, target_mbs, return_outputs, loss_kwargs, explicit).run(self._rank_actions())
        self._update_losses(self._stages, losses)
        if not explicit:  # an explicit plan scales where its REDUCE_GRAD actions say (none: unscaled, as in PyTorch)
            for stage in self._stages:
                stage.perform_reduce_grad(self._n_microbatches if self.scale_grads and self._has_backward else 1)

    def _explicit_comms(self) -> bool:
        """Does the plan hold its SEND/RECV actions (else the executor sends and receives around compute)?"""
        return False


class PipelineScheduleSingle(_PipelineSchedule):
    """A schedule with one stage per rank (stage i on group rank i)."""

    def __init__(
        self,
        stage: PipelineStage,
        n_microbatches: int,
        loss_fn: Callable | None = None,
        args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
        kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
        output_merge_spec: dict[str, Any] | tuple[Any] | None = None,
        scale_grads: bool = True,
    ) -> None:
        super().__init__(n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads)
        if not isinstance(stage, PipelineStage):
            raise TypeError(f"{type(self).__name__} takes one PipelineStage, got {type(stage).__name__}")
        if stage.num_stages != stage.group_size:
            raise ValueError(
                f"{type(self).__name__} runs one stage per rank, but the pipeline has {stage.num_stages} stages on "
                f"{stage.group_size} ranks; use a multi-stage schedule such as ScheduleInterleaved1F1B"
            )
        self._stage = stage
        self._num_stages = stage.num_stages
        self._stages = [stage]


class ScheduleGPipe(PipelineScheduleSingle):
    """Fill and drain: every microbatch forward, then every microbatch backward."""

    def _rank_actions(self) -> list[_Action]:
        return _plans.gpipe(self._stage.stage_index, self._n_microbatches)


class Schedule1F1B(PipelineScheduleSingle):
    """One forward, one backward in steady state: at most ``num_stages - stage_index`` microbatches in flight."""

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
                 kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
                 output_merge_spec: dict[str, Any] | tuple[Any] | None = None, scale_grads: bool = True) -> None:
        super().__init__(stage, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads)
        if n_microbatches < self._num_stages:
            raise ValueError(
                f"Number of microbatches ({n_microbatches}) must be greater than or equal to the number of stages "
                f"({self._num_stages})."
            )

    def _rank_actions(self) -> list[_Action]:
        return _plans.one_f_one_b(self._stage.stage_index, self._num_stages, self._n_microbatches)


class _ScheduleForwardOnly(PipelineScheduleSingle):
    """Inference: every microbatch's forward in order, no loss and no backward (PyTorch's private
    schedule of that name). The last stage's ``step`` returns the merged outputs."""

    def _step_microbatches(self, arg_mbs: list | None = None, kwarg_mbs: list | None = None,
                           target_mbs: list | None = None, losses: list | None = None, return_outputs: bool = True,
                           loss_kwargs: dict[str, Any] | None = None) -> None:
        if target_mbs is not None or losses is not None:
            raise RuntimeError("Forward-only schedule does not support loss computation")
        super()._step_microbatches(arg_mbs, kwarg_mbs, None, None, return_outputs, loss_kwargs)

    def _rank_actions(self) -> list[_Action]:
        return [_Action(self._stage.stage_index, _ComputationType.FORWARD, mb) for mb in range(self._n_microbatches)]


class PipelineScheduleMulti(_PipelineSchedule):
    """A schedule with several stages per rank; ``stages`` are this rank's, in increasing stage index.

    The built-in subclasses compute ``pipeline_order`` (every rank's plan) in their constructor; this class runs
    one loaded with ``_load_csv`` (compute only), which also decides which rank holds which stage."""

    _placement_style: str | None = None  # None: stage s on rank s % P until a loaded schedule says otherwise

    def __init__(
        self,
        stages: list[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable | None = None,
        args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
        kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
        output_merge_spec: dict[str, Any] | tuple[Any] | None = None,
        use_full_backward: bool | None = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
    ) -> None:
        super().__init__(n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads)
        if not isinstance(stages, (list, tuple)) or not stages or not all(isinstance(s, PipelineStage)
                                                                          for s in stages):
            raise TypeError(f"{type(self).__name__} takes a non-empty list of PipelineStage, got {stages!r}")
        self._stages = sorted(stages, key=lambda s: s.stage_index)
        self._num_stages = stages[0].num_stages
        self.pp_group_size = stages[0].group_size
        self.rank = stages[0].group_rank
        self._backward_requires_autograd = backward_requires_autograd
        if use_full_backward is not None:
            logger.warning("Deprecation warning: 'use_full_backward' is no longer supported. Simply stop passing "
                           "it, and everything should still work fine.")
        for stage in self._stages:
            if stage.num_stages != self._num_stages:
                raise ValueError(f"{type(self).__name__}: stages disagree on num_stages: "
                                 f"{[s.num_stages for s in self._stages]}")
        style = self._placement_style or "loop"
        placement = _plans.stage_to_rank(self.pp_group_size, self._num_stages, style)
        if self._placement_style is not None:
            self._check_placement(placement, f"{style} placement")
        self._set_placement(placement)
        self.n_local_stages = len(self._stages)
        self.pipeline_order: dict[int, list[_Action | None]] = {}

    def _check_placement(self, placement: dict[int, int], why: str) -> None:
        mine = sorted(s for s, r in placement.items() if r == self.rank)
        given = [s.stage_index for s in self._stages]
        if given != mine:
            raise ValueError(
                f"{type(self).__name__} on group rank {self.rank}: with {self._num_stages} stages on "
                f"{self.pp_group_size} ranks ({why}) this rank holds stages {mine}, but was given stages {given}"
            )

    def _set_placement(self, placement: dict[int, int]) -> None:
        self.stage_index_to_group_rank = dict(placement)
        for stage in self._stages:
            stage.stage_index_to_group_rank = dict(placement)

    def _validate_and_set_stage_mapping(self, actions: dict[int, list[_Action | None]]) -> None:
        """Check ``actions`` (PyTorch's checks and messages) and take the stage -> rank mapping they imply."""
        placement = _validate_schedule(actions, self.pp_group_size, self._num_stages, self._n_microbatches)
        self._check_placement(placement, "as the schedule places them")
        self._set_placement(placement)

    def _rank_actions(self) -> list[_Action | None]:
        if self.rank not in self.pipeline_order:
            raise RuntimeError(f"{type(self).__name__} has no schedule for rank {self.rank}: load one with _load_csv")
        return self.pipeline_order[self.rank]

    def _dump_csv(self, filename: str) -> None:
        """Write ``pipeline_order`` to ``filename``: one row per rank, one action per cell (see ``_actions``)."""
        _actions.write_csv(filename, self.pipeline_order)

    def _load_csv(self, filename: str, format: Literal["compute_only", "compute_comms"] = "compute_only") -> None:
        """Read a compute-only schedule written by ``_dump_csv`` (here or in PyTorch), check it, and use it."""
        if format != "compute_only":
            raise AssertionError(f'format must be "compute_only", got {format}')
        self.pipeline_order = _actions.read_csv(filename)
        self._validate_and_set_stage_mapping(self.pipeline_order)


class _PipelineScheduleRuntime(PipelineScheduleMulti):
    """Runs a schedule with explicit communication actions (``pipeline_order_with_comms``), as PyTorch's class of
    that name: load a compute-only schedule (lowered here, see ``_actions``) or a compute + comms one with
    ``_load_csv``/``_load_actions``; the built-in multi-stage schedules lower their own plan in their constructor."""

    def __init__(self, *args: Any, defer_pp_recv: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._defer_pp_recv = defer_pp_recv  # accepted; receives are posted where the lowering places them
        self.pipeline_order_with_comms: dict[int, list[_Action]] | None = None

    def _explicit_comms(self) -> bool:
        return True

    def _rank_actions(self) -> list[_Action | None]:
        if self.pipeline_order_with_comms is None:
            raise RuntimeError(
                f"{type(self).__name__} has no schedule: load one with _load_csv or _load_actions before step()")
        return self.pipeline_order_with_comms[self.rank]

    def _prepare_schedule_with_comms(self, actions: dict[int, list[_Action | None]],
                                     format: Literal["compute_only", "compute_comms"] = "compute_only") -> None:
        """Check ``actions`` and make ``pipeline_order_with_comms`` of them: as given (compute_comms), or lowered
        by PyTorch's passes, UNSHARD/RESHARD, REDUCE_GRAD, SEND/RECV (compute_only)."""
        self._validate_and_set_stage_mapping(actions)
        if format == "compute_comms":
            lowered = {}
            for rank, row in actions.items():
                for action in row:
                    if action is None:
                        raise AssertionError(f"Expected action to be not None, got {type(action)}")
                lowered[rank] = list(row)
        elif format == "compute_only":
            _actions.check_compute_only(actions)
            per_rank = {rank: _add_reduce_grad(_add_unshard_reshard(row), self._n_microbatches)
                        for rank, row in actions.items()}
            lowered = _add_send_recv(per_rank, lambda s: self.stage_index_to_group_rank[s], self._num_stages)
        else:
            raise NotImplementedError(f"{format=} is not implemented")
        self.pipeline_order_with_comms = lowered

    def _load_actions(self, actions: dict[int, list[_Action | None]],
                      format: Literal["compute_only", "compute_comms"] = "compute_only") -> None:
        """Use ``actions`` ({rank: [action or None, ...]}) as the schedule; ``_load_csv`` without the file."""
        if format == "compute_only":
            self.pipeline_order = {rank: list(row) for rank, row in actions.items()}
            self._prepare_schedule_with_comms(self.pipeline_order)
        elif format == "compute_comms":
            self._prepare_schedule_with_comms(actions, format=format)
        else:
            raise NotImplementedError(f"{format=} is not implemented")

    def _load_csv(self, filename: str, format: Literal["compute_only", "compute_comms"] = "compute_only") -> None:
        """Read a schedule (compute_only: lowered here; compute_comms: run as written), check it, and use it."""
        if format not in ("compute_only", "compute_comms"):
            raise NotImplementedError(f"{format=} is not implemented")
        self._load_actions(_actions.read_csv(filename), format)

    def _dump_csv(self, filename: str, format: Literal["compute_only", "compute_comms"] = "compute_comms") -> None:
        """Write the schedule: with its communication actions (the default, as in PyTorch) or compute only."""
        if format == "compute_only":
            _actions.write_csv(filename, self.pipeline_order)
        elif format == "compute_comms":
            if self.pipeline_order_with_comms is None:
                raise AssertionError("Must initialize compute_comms schedule before dump_csv")
            _actions.write_csv(filename, self.pipeline_order_with_comms)

    def _simulate(self) -> dict[int, list[_Action | None]]:
        """The lowered schedule on all ranks in unit steps (see ``_actions.simulate_comms_compute``)."""
        return _simulate_comms_compute(self.pipeline_order_with_comms, lambda s: self.stage_index_to_group_rank[s],
                                       self._num_stages)


class _Rounds:
    """Interleaved schedules walk microbatches in rounds of ``microbatches_per_round``."""

    def _set_rounds(self, n_microbatches: int, pp_group_size: int, what: str) -> None:
        self.number_of_rounds = max(1, n_microbatches // pp_group_size)
        self.microbatches_per_round = n_microbatches // self.number_of_rounds
        if n_microbatches % self.number_of_rounds != 0:
            raise ValueError(
                f"{what} requires the number of microbatches to be a multiple of the number of rounds "
                f"({self.number_of_rounds}), but got {n_microbatches}."
            )


class ScheduleInterleaved1F1B(_PipelineScheduleRuntime, _Rounds):
    """Megatron's interleaved 1F1B: several stages per rank (stage s on rank s % P), depth first."""

    _placement_style = "loop"

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
                 kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
                 output_merge_spec: dict[str, Any] | tuple[Any] | None = None, scale_grads: bool = True,
                 backward_requires_autograd: bool = True, defer_pp_recv: bool = False) -> None:
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads=scale_grads, backward_requires_autograd=backward_requires_autograd,
                         defer_pp_recv=defer_pp_recv)
        self._set_rounds(n_microbatches, self.pp_group_size, "Interleaved 1F1B")
        self.pipeline_order = {
            r: _plans.interleaved_1f1b(r, self.pp_group_size, self.n_local_stages, n_microbatches,
                                       self.microbatches_per_round)
            for r in range(self.pp_group_size)
        }
        self._prepare_schedule_with_comms(self.pipeline_order)


class ScheduleLoopedBFS(_PipelineScheduleRuntime):
    """Breadth first: all microbatches through local stage 0, then local stage 1, ...; backwards in reverse."""

    _placement_style = "loop"

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 output_merge_spec: dict[str, Any] | tuple[Any] | None = None, scale_grads: bool = True,
                 backward_requires_autograd: bool = True, defer_pp_recv: bool = False) -> None:
        super().__init__(stages, n_microbatches, loss_fn, output_merge_spec=output_merge_spec,
                         scale_grads=scale_grads, backward_requires_autograd=backward_requires_autograd,
                         defer_pp_recv=defer_pp_recv)
        self.pipeline_order = {r: _plans.looped_bfs(r, self.pp_group_size, self.n_local_stages, n_microbatches)
                               for r in range(self.pp_group_size)}
        self._prepare_schedule_with_comms(self.pipeline_order)


class ScheduleInterleavedZeroBubble(_PipelineScheduleRuntime, _Rounds):
    """Zero bubble with looped placement (stage s on rank s % P): backward split into input gradients (I, on the
    critical path) and weight gradients (W, filling bubbles), ordered by ``_plans.zero_bubble``."""

    _placement_style = "loop"

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
                 kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
                 output_merge_spec: dict[str, Any] | tuple[Any] | None = None, scale_grads: bool = True,
                 backward_requires_autograd: bool = True, defer_pp_recv: bool = False) -> None:
        _check_not_compiled(stages, type(self).__name__)
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads=scale_grads, backward_requires_autograd=backward_requires_autograd,
                         defer_pp_recv=defer_pp_recv)
        self._set_rounds(n_microbatches, self.pp_group_size, "Zero bubble")
        p, v, per_round = self.pp_group_size, self.n_local_stages, self.microbatches_per_round
        self.pipeline_order = _plans.zero_bubble(self._num_stages, p, n_microbatches, self.stage_index_to_group_rank,
                                                 lambda r: v * per_round + 2 * (p - 1 - r) + 1)
        self._prepare_schedule_with_comms(self.pipeline_order)


class ScheduleZBVZeroBubble(_PipelineScheduleRuntime):
    """Zero bubble with V placement: rank r holds stages r and 2P - 1 - r (the first and last stage share rank 0)."""

    _placement_style = "v"

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
                 kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
                 output_merge_spec: dict[str, Any] | tuple[Any] | None = None, scale_grads: bool = True,
                 backward_requires_autograd: bool = True, defer_pp_recv: bool = False) -> None:
        _check_not_compiled(stages, type(self).__name__)
        if isinstance(stages, (list, tuple)) and len(stages) != 2:
            raise ValueError(f"ZBV requires exactly 2 stages per rank, but got {len(stages)}.")
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads=scale_grads, backward_requires_autograd=backward_requires_autograd,
                         defer_pp_recv=defer_pp_recv)
        self.num_stages = self._num_stages
        self.pipeline_order = {r: _plans.zbv(r, self.pp_group_size, n_microbatches) for r in range(self.pp_group_size)}
        self._prepare_schedule_with_comms(self.pipeline_order)


class ScheduleDualPipeV(_PipelineScheduleRuntime):
    """DeepSeek's DualPipe folded into a V (arXiv:2412.19437): rank r holds stages r and 2P - 1 - r, and in steady
    state overlaps the forward of one with the backward of the other (here: runs one, then the other)."""

    _placement_style = "v"

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
                 kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
                 output_merge_spec: dict[str, Any] | tuple[Any] | None = None, scale_grads: bool = True,
                 backward_requires_autograd: bool = True, defer_pp_recv: bool = False) -> None:
        _check_not_compiled(stages, type(self).__name__)
        if isinstance(stages, (list, tuple)) and len(stages) != 2:
            raise ValueError(f"ZBV requires exactly 2 stages per rank, but got {len(stages)}.")
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads=scale_grads, backward_requires_autograd=backward_requires_autograd,
                         defer_pp_recv=defer_pp_recv)
        if n_microbatches < self._num_stages:
            raise ValueError(
                "DualPipeV requires at least as many microbatches as stages, but got "
                f"{n_microbatches} microbatches and {self._num_stages} stages."
            )
        self.num_stages = self._num_stages
        self.pipeline_order = {r: _plans.dualpipe_v(r, self.pp_group_size, n_microbatches)
                               for r in range(self.pp_group_size)}
        self._prepare_schedule_with_comms(self.pipeline_order)


def _check_not_compiled(stages: Any, schedule_name: str) -> None:
    """PyTorch refuses torch.compile'd stage modules in the zero-bubble schedules and DualPipeV (they split
    backward into I and W); so do we."""
    for stage in stages if isinstance(stages, (list, tuple)) else ():
        submod = getattr(stage, "submod", None)
        if not isinstance(submod, torch.nn.Module):
            continue
        for module in submod.modules():
            if type(module).__name__ == "OptimizedModule":  # torch._dynamo's wrapper, not imported (slow)
                raise RuntimeError(
                    f"The {schedule_name} schedule is not supported with stage modules that have used torch.compile. "
                    f"Found OptimizedModule in {type(module).__name__}"
                )


_SCHEDULES: dict[str, type] = {
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "GPipe": ScheduleGPipe,
    "LoopedBFS": ScheduleLoopedBFS,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "PipelineScheduleSingle": PipelineScheduleSingle,
    "PipelineScheduleMulti": PipelineScheduleMulti,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "DualPipeV": ScheduleDualPipeV,
}


def get_schedule_class(schedule_name: str) -> type:
    """The schedule class called ``schedule_name`` (case insensitive), e.g. ``"1f1b"``."""
    by_lower = {name.lower(): cls for name, cls in _SCHEDULES.items()}
    if schedule_name.lower() not in by_lower:
        raise ValueError(
            f"Unknown schedule name '{schedule_name}'. The valid options are {list(_SCHEDULES)}"
        )
    return by_lower[schedule_name.lower()]
