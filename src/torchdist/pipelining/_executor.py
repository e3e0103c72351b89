"""The one executor of a rank's actions in a step, for both forms of a schedule (see ``_actions``).

Compute only (``explicit_comms=False``): a compute action receives what it
needs right before it runs (``PipelineStage`` posts the receive if nothing
did) and sends what it produced right after. Compute + comms
(``explicit_comms=True``): RECV_F/RECV_B post the receive, the compute action
waits for it (and raises if it was never posted, as PyTorch does), SEND_F/
SEND_B start the send. In both forms a neighbouring stage on the same rank
gets its tensors handed over directly, and sends are waited for only at the
end of the step. An OVERLAP_F_B runs its sub-actions in order (no streams on
CPU). UNSHARD/RESHARD act on the FSDP modules of a stage (all-gather its
parameters, free them) and do nothing on a plain module; REDUCE_GRAD scales
the stage's gradients by the number of microbatches (``scale_grads``). A
compute-only plan has none: the caller scales every stage after the step. A
compute + comms plan without one leaves that stage's gradients unscaled, as
in PyTorch.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from . import _comm
from ._plans import B, F, I, OVERLAP_F_B, RECV_B, RECV_F, REDUCE_GRAD, RESHARD, SEND_B, SEND_F, UNSHARD, W, _Action
from .stage import PipelineStage

__all__ = ["Executor"]

_FORWARD_RECV, _BACKWARD_RECV = 0, 1  # the keys of PipelineStage._recv_works


def _is_fsdp(module: Any) -> bool:
    """An FSDP-wrapped module (``fully_shard``): one whose class has ``unshard`` and ``reshard`` (duck typed, so that
    this layer does not import ``torchdist.fsdp``, which sits beside it)."""
    return callable(getattr(type(module), "unshard", None)) and callable(getattr(type(module), "reshard", None))


def _fsdp_modules(stage: PipelineStage) -> list[Any]:
    """The FSDP-wrapped modules of the stage, if its submodule is one (PyTorch only looks then)."""
    if not _is_fsdp(stage.submod):
        return []
    return [m for m in stage.submod.modules() if _is_fsdp(m)]


class Executor:
    """Runs the actions of one rank for one step of ``schedule`` (a ``_PipelineSchedule``)."""

    def __init__(self, schedule: Any, arg_mbs: list, kwarg_mbs: list, target_mbs: list | None,
                 return_outputs: bool, loss_kwargs: dict | None, explicit_comms: bool) -> None:
        self.schedule = schedule
        self.stages: dict[int, PipelineStage] = {s.stage_index: s for s in schedule._stages}
        self.arg_mbs, self.kwarg_mbs, self.target_mbs = arg_mbs, kwarg_mbs, target_mbs
        self.return_outputs, self.loss_kwargs = return_outputs, loss_kwargs
        self.explicit = explicit_comms
        self.backward = schedule._has_backward
        self.losses: dict[int, torch.Tensor] = {}
        self.sends: list = []
        self.unshard_ops: dict[int, list] = defaultdict(list)
        self.unsharded: set[int] = set()
        self._fsdp_of: dict[int, list[Any]] = {}

    def run(self, actions: list[_Action | None]) -> None:
        """Run ``actions`` in order, then wait for the sends."""
        for action in actions:
            if action is None:
                continue
            if action.computation_type is OVERLAP_F_B:
                if action.sub_actions is None:
                    raise AssertionError("sub_actions must be set")
                for sub in action.sub_actions:
                    self._one(sub)
            else:
                self._one(action)
        rank = self.schedule._stages[0].group_rank
        _comm.wait_all(self.sends, lambda: f"pipeline rank {rank}: completing the sends of this step failed")
        if self.unshard_ops:
            raise AssertionError("Unused unshard operations")

    def _stage(self, action: _Action) -> PipelineStage:
        if action.stage_index not in self.stages:
            raise RuntimeError(f"pipeline rank {self.schedule._stages[0].group_rank} was given action {action}, "
                               f"but holds only stages {sorted(self.stages)}")
        return self.stages[action.stage_index]

    def _one(self, action: _Action) -> None:
        kind, mb = action.computation_type, action.microbatch_index
        if mb is None and kind not in (UNSHARD, RESHARD, REDUCE_GRAD):
            raise AssertionError(f"{action=} missing mb_index")
        stage = self._stage(action)
        nxt, prev = self.stages.get(stage.stage_index + 1), self.stages.get(stage.stage_index - 1)
        if kind is F:
            self._forward(stage, mb, action, nxt)
        elif kind is UNSHARD:
            self._unshard(stage)
        elif kind is RESHARD:
            self._reshard(stage)
        elif kind is SEND_F:
            self._check_remote(stage, nxt, action)
            self.sends += stage.send_forward(mb, None)
        elif kind is RECV_F:
            self._check_remote(stage, prev, action)
            self._check_not_posted(stage, _FORWARD_RECV, mb, "forward")
            stage.post_fwd_recv(mb)
        elif not self.backward:
            return  # eval(): forwards only
        elif kind in (B, I):
            self._ensure_unsharded(stage)
            if self.explicit and not stage.is_last and nxt is None and (_BACKWARD_RECV, mb) not in stage._recv_works:
                raise AssertionError(f"Attempted to run compute {action=} before receiving input")
            stage.backward_one_chunk(mb, loss=self.losses.get(mb) if stage.is_last else None, full_backward=kind is B)
            if not self.explicit or prev is not None:
                self.sends += stage.send_backward(mb, prev)
        elif kind is W:
            self._ensure_unsharded(stage)
            stage.backward_weight_one_chunk(mb)
        elif kind is SEND_B:
            self._check_remote(stage, prev, action)
            self.sends += stage.send_backward(mb, None)
        elif kind is RECV_B:
            self._check_remote(stage, nxt, action)
            self._check_not_posted(stage, _BACKWARD_RECV, mb, "backward")
            stage.post_bwd_recv(mb)
        elif kind is REDUCE_GRAD:
            stage.perform_reduce_grad(self.schedule._n_microbatches if self.schedule.scale_grads else 1)
        else:
            raise ValueError(f"{action=} is unknown or unsupported")

    def _forward(self, stage: PipelineStage, mb: int, action: _Action, nxt: PipelineStage | None) -> None:
        self._ensure_unsharded(stage)
        if (self.explicit and not stage.is_first and stage.stage_index - 1 not in self.stages
                and (_FORWARD_RECV, mb) not in stage._recv_works):
            raise AssertionError(f"Computing {action=} before receiving input")
        output = stage.forward_one_chunk(mb, self.arg_mbs[mb], self.kwarg_mbs[mb],
                                         save_forward_output=self.return_outputs)
        schedule = self.schedule
        if stage.is_last and schedule._loss_fn is not None and self.target_mbs is not None:
            self.losses[mb] = schedule._compute_loss(output, self.target_mbs[mb], self.loss_kwargs)
            schedule._internal_losses.append(self.losses[mb])
        if not self.explicit or nxt is not None:
            self.sends += stage.send_forward(mb, nxt)

    def _check_remote(self, stage: PipelineStage, neighbour: PipelineStage | None, action: _Action) -> None:
        if neighbour is not None:
            raise ValueError(f"{action}: stages {stage.stage_index} and {neighbour.stage_index} are both on this rank "
                             "and hand their tensors over directly; remove the communication action")

    @staticmethod
    def _check_not_posted(stage: PipelineStage, direction: int, mb: int, compute: str) -> None:
        if (direction, mb) in stage._recv_works:
            raise AssertionError(f"Recv twice for stage_idx={stage.stage_index} mb_index={mb} without executing "
                                 f"{compute}")

    # -- FSDP ---------------------------------------------------------------------------------------------------
    def _fsdp(self, stage: PipelineStage) -> list[Any]:
        if stage.stage_index not in self._fsdp_of:
            self._fsdp_of[stage.stage_index] = _fsdp_modules(stage)
        return self._fsdp_of[stage.stage_index]

    def _unshard(self, stage: PipelineStage) -> None:
        modules = self._fsdp(stage)
        if not modules:
            return
        idx = stage.stage_index
        if idx in self.unsharded or idx in self.unshard_ops:
            raise AssertionError(f"Unsharding the same stage_idx={idx} twice")
        self.unshard_ops[idx] = [m.unshard(async_op=True) for m in modules]

    def _reshard(self, stage: PipelineStage) -> None:
        modules = self._fsdp(stage)
        if not modules:
            return
        idx = stage.stage_index
        if idx not in self.unsharded:
            raise AssertionError(f"Resharding stage_idx={idx} without unsharding")
        if idx in self.unshard_ops:
            raise AssertionError(f"Resharding stage_idx={idx} before finishing unshard")
        for module in modules:
            module.reshard()
        self.unsharded.remove(idx)

    def _ensure_unsharded(self, stage: PipelineStage) -> None:
        """Before computing on an FSDP stage: wait for its UNSHARD; computing on a sharded stage is an error."""
        if not self.explicit or not self._fsdp(stage):
            return
        idx = stage.stage_index
        if idx in self.unshard_ops:
            for handle in self.unshard_ops.pop(idx):
                if handle is not None:
                    handle.wait()
            self.unsharded.add(idx)
        if idx not in self.unsharded:
            raise AssertionError(f"Attempted to compute on sharded stage_idx={idx}")
