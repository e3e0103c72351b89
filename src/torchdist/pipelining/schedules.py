"""Pipeline schedules: split a batch into microbatches and run each rank's plan of forwards and backwards.

``step(*args, target=..., losses=...)`` is the whole training step of one rank:
the first stage gets the inputs, the last stage the target; the batch is cut
into ``n_microbatches``; the plan from ``_plans`` runs, receiving what an
action needs right before it and sending what it produced right after
(``isend``: a rank never waits for its sends until the end of the step);
losses are collected on the last stage, outputs merged there, and gradients
divided by ``n_microbatches`` when ``scale_grads``. An OVERLAP_F_B action
(DualPipeV) runs its forward, then its backward: on CPU there are no streams
to run them at once, and the result is the same.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, Callable

import torch

from . import _comm, _plans
from ._plans import _Action, _ComputationType
from .microbatch import _TARGET_CHUNK_SPEC, TensorChunkSpec, _split_tensor, merge_chunks, split_args_kwargs_into_chunks
from .stage import PipelineStage

__all__ = ["PipelineScheduleSingle", "PipelineScheduleMulti", "ScheduleGPipe", "Schedule1F1B",
           "ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
           "ScheduleDualPipeV", "get_schedule_class", "_Action", "_ComputationType"]

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
        self._execute(self._rank_actions(), arg_mbs, kwarg_mbs, target_mbs, return_outputs, loss_kwargs)
        self._update_losses(self._stages, losses)
        for stage in self._stages:
            stage.perform_reduce_grad(self._n_microbatches if self.scale_grads and self._has_backward else 1)

    def _execute(self, actions: list[_Action], arg_mbs: list, kwarg_mbs: list, target_mbs: list | None,
                 return_outputs: bool, loss_kwargs: dict | None) -> None:
        """Run ``actions`` in order; receive right before an action, send right after it."""
        stages = {s.stage_index: s for s in self._stages}
        losses: dict[int, torch.Tensor] = {}
        sends = []
        backward = self._has_backward
        for action in _plans.compute_actions(actions):  # an OVERLAP_F_B: its forward, then its backward
            stage = stages[action.stage_index]
            kind, mb = action.computation_type, action.microbatch_index
            if kind is _ComputationType.FORWARD:
                output = stage.forward_one_chunk(mb, arg_mbs[mb], kwarg_mbs[mb], save_forward_output=return_outputs)
                if stage.is_last and self._loss_fn is not None and target_mbs is not None:
                    losses[mb] = self._compute_loss(output, target_mbs[mb], loss_kwargs)
                    self._internal_losses.append(losses[mb])
                sends += stage.send_forward(mb, stages.get(stage.stage_index + 1))
            elif not backward:
                continue
            elif kind in (_ComputationType.FULL_BACKWARD, _ComputationType.BACKWARD_INPUT):
                stage.backward_one_chunk(mb, loss=losses.get(mb) if stage.is_last else None,
                                         full_backward=kind is _ComputationType.FULL_BACKWARD)
                sends += stage.send_backward(mb, stages.get(stage.stage_index - 1))
            elif kind is _ComputationType.BACKWARD_WEIGHT:
                stage.backward_weight_one_chunk(mb)
            else:
                raise ValueError(f"{action=} is unknown or unsupported")
        rank = self._stages[0].group_rank
        _comm.wait_all(sends, lambda: f"pipeline rank {rank}: completing the sends of this step failed")


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
    """A schedule with several stages per rank; ``stages`` are this rank's, in increasing stage index."""

    _placement_style = "loop"

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
        self.stage_index_to_group_rank = _plans.stage_to_rank(self.pp_group_size, self._num_stages,
                                                              self._placement_style)
        mine = sorted(s for s, r in self.stage_index_to_group_rank.items() if r == self.rank)
        given = [s.stage_index for s in self._stages]
        if given != mine:
            raise ValueError(
                f"{type(self).__name__} on group rank {self.rank}: with {self._num_stages} stages on "
                f"{self.pp_group_size} ranks ({self._placement_style} placement) this rank holds stages {mine}, "
                f"but was given stages {given}"
            )
        for stage in self._stages:
            if stage.num_stages != self._num_stages:
                raise ValueError(f"{type(self).__name__}: stages disagree on num_stages: "
                                 f"{[s.num_stages for s in self._stages]}")
            stage.stage_index_to_group_rank = dict(self.stage_index_to_group_rank)
        self.n_local_stages = len(self._stages)
        self.pipeline_order: dict[int, list[_Action]] = {}

    def _rank_actions(self) -> list[_Action]:
        return self.pipeline_order[self.rank]


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


class ScheduleInterleaved1F1B(PipelineScheduleMulti, _Rounds):
    """Megatron's interleaved 1F1B: several stages per rank (stage s on rank s % P), depth first."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
                 kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
                 output_merge_spec: dict[str, Any] | tuple[Any] | None = None, scale_grads: bool = True,
                 backward_requires_autograd: bool = True, defer_pp_recv: bool = False) -> None:
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads=scale_grads, backward_requires_autograd=backward_requires_autograd)
        self._set_rounds(n_microbatches, self.pp_group_size, "Interleaved 1F1B")
        self.pipeline_order = {
            r: _plans.interleaved_1f1b(r, self.pp_group_size, self.n_local_stages, n_microbatches,
                                       self.microbatches_per_round)
            for r in range(self.pp_group_size)
        }


class ScheduleLoopedBFS(PipelineScheduleMulti):
    """Breadth first: all microbatches through local stage 0, then local stage 1, ...; backwards in reverse."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 output_merge_spec: dict[str, Any] | tuple[Any] | None = None, scale_grads: bool = True,
                 backward_requires_autograd: bool = True, defer_pp_recv: bool = False) -> None:
        super().__init__(stages, n_microbatches, loss_fn, output_merge_spec=output_merge_spec,
                         scale_grads=scale_grads, backward_requires_autograd=backward_requires_autograd)
        self.pipeline_order = {r: _plans.looped_bfs(r, self.pp_group_size, self.n_local_stages, n_microbatches)
                               for r in range(self.pp_group_size)}


class _ZeroBubble(PipelineScheduleMulti):
    """Backward split into input gradients (I, on the critical path) and weight gradients (W, fills bubbles)."""

    def _zero_bubble_order(self, in_flight: Callable[[int], int]) -> None:
        self.pipeline_order = _plans.zero_bubble(self._num_stages, self.pp_group_size, self._n_microbatches,
                                                 self.stage_index_to_group_rank, in_flight)


class ScheduleInterleavedZeroBubble(_ZeroBubble, _Rounds):
    """Zero bubble with looped placement (stage s on rank s % P)."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
                 kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
                 output_merge_spec: dict[str, Any] | tuple[Any] | None = None, scale_grads: bool = True,
                 backward_requires_autograd: bool = True, defer_pp_recv: bool = False) -> None:
        _check_not_compiled(stages, type(self).__name__)
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads=scale_grads, backward_requires_autograd=backward_requires_autograd)
        self._set_rounds(n_microbatches, self.pp_group_size, "Zero bubble")
        p, v, per_round = self.pp_group_size, self.n_local_stages, self.microbatches_per_round
        self._zero_bubble_order(lambda r: v * per_round + 2 * (p - 1 - r) + 1)


class ScheduleZBVZeroBubble(_ZeroBubble):
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
                         scale_grads=scale_grads, backward_requires_autograd=backward_requires_autograd)
        self.num_stages = self._num_stages
        self._zero_bubble_order(lambda r: 2 * self.pp_group_size)


class ScheduleDualPipeV(PipelineScheduleMulti):
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
                         scale_grads=scale_grads, backward_requires_autograd=backward_requires_autograd)
        if n_microbatches < self._num_stages:
            raise ValueError(
                "DualPipeV requires at least as many microbatches as stages, but got "
                f"{n_microbatches} microbatches and {self._num_stages} stages."
            )
        self.num_stages = self._num_stages
        self.pipeline_order = {r: _plans.dualpipe_v(r, self.pp_group_size, n_microbatches)
                               for r in range(self.pp_group_size)}


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
