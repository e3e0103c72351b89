"""The parameters of one ``fully_shard`` call, communicated together: when they are gathered, freed and reduced.

States of a group (``unshard`` and ``reshard`` move between them)::

    SHARDED --unshard()--> GATHERING --wait()--> UNSHARDED --reshard()--> SHARDED
                                ^                    |
                                +-- unshard() -- SHARDED_POST_FORWARD   (reshard_after_forward=k, after forward)

The module sees the sharded DTensor parameters while SHARDED and the unsharded
plain parameters while UNSHARDED. Within one training step:

- pre-forward: unshard and wait; wrap the forward inputs so that autograd calls
  ``post_backward`` once the module's backward has produced their gradients;
- post-forward: reshard if ``reshard_after_forward`` (else keep for backward);
- pre-backward (a hook on the outputs' gradients): unshard again if needed and
  prefetch the group whose backward comes next;
- post-backward: take the unsharded gradients, reshard if
  ``reshard_after_backward``, and reduce-scatter them into the sharded ``.grad``
  (or keep them unsharded when gradient sync is off).
"""

from __future__ import annotations

import enum
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ._api import AllGather, DefaultAllGather, DefaultReduceScatter, ReduceScatter
from ._collectives import GroupAllGather, reduce_gradients
from ._mesh_info import MeshInfo
from ._param import FSDPParam

__all__ = ["TrainingState", "FSDPParamGroup"]


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


class FSDPParamGroup:
    """One all-gather and one reduce-scatter unit: the parameters, their modules, and the knobs users set."""

    def __init__(self, params: list[FSDPParam], modules: tuple[nn.Module, ...], mesh_info: MeshInfo,
                 reshard_after_forward: bool, post_forward_mesh_info: MeshInfo | None = None) -> None:
        self.params = params
        self.modules = modules
        self.mesh_info = mesh_info
        self.reshard_after_forward = reshard_after_forward
        # reshard_after_forward=k: after forward keep 1/k shards, on this (W/k, k) mesh
        self.post_forward_mesh_info = post_forward_mesh_info
        self.training_state = TrainingState.IDLE
        # user knobs (FSDPModule.set_*)
        self.reduce_grads = True
        self.all_reduce_grads = True
        self.reshard_after_backward = True
        self.unshard_in_backward = True
        self.reduce_scatter_unused_params = False
        self.gradient_divide_factor: float | None = None
        self.force_sum_reduction_for_comms = False
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.unshard_async_op = False
        self.all_gather_comm: AllGather = DefaultAllGather()
        self.reduce_scatter_comm: ReduceScatter = DefaultReduceScatter()
        self.fqn = ""
        self.post_forward_order: list[FSDPParamGroup] | None = None  # shared by all groups of a root, at lazy init
        self._gathering: GroupAllGather | None = None
        self._unsharded = False
        self._sharded_post_forward = False
        self._post_forward_indices: list[int] = []
        self._partial_reduce: torch.Tensor | None = None
        self._register_state_dict_hooks()

    # -- unshard / reshard ---------------------------------------------------------------------------------

    @property
    def is_unsharded(self) -> bool:
        return self._unsharded

    def unshard(self, async_op: bool = False) -> None:
        """Start the all-gather (no-op if the parameters are unsharded or being gathered)."""
        if self._unsharded or self._gathering is not None:
            return
        if self._sharded_post_forward:  # gather within the smaller post-forward groups
            self._gathering = GroupAllGather(self.params, self.post_forward_mesh_info, async_op, self.all_gather_comm,
                                             post_forward=True)
            return
        for param in self.params:
            param.refresh_sharded()
        self._gathering = GroupAllGather(self.params, self.mesh_info, async_op, self.all_gather_comm)

    def wait_for_unshard(self) -> None:
        """Finish a started all-gather and register the unsharded parameters on the modules."""
        if self._gathering is None:
            return
        gathering, self._gathering = self._gathering, None
        gathering.wait_and_copy_out()
        for param in self.params:
            param.register(param.unsharded_param)
        self._unsharded = True
        self._sharded_post_forward = False

    def reshard(self) -> None:
        """Register the sharded parameters again and free the unsharded storage (or the post-forward shards)."""
        if self._gathering is not None:  # an unshard nobody waited for: finish it so the collective completes
            self.wait_for_unshard()
        if not (self._unsharded or self._sharded_post_forward):
            return
        for param in self.params:
            param.register(param.sharded_param)
            param.free_unsharded()
        self._unsharded = self._sharded_post_forward = False

    def _reshard_post_forward(self) -> None:
        """``reshard_after_forward=k``: keep ``1/k`` shards (on the post-forward mesh) instead of the full ones."""
        if not self._unsharded:
            return
        for param in self.params:
            param.to_post_forward(self.post_forward_mesh_info)
        self._unsharded, self._sharded_post_forward = False, True

    # -- forward -------------------------------------------------------------------------------------------

    def pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        entering = self.training_state != TrainingState.FORWARD
        self.training_state = TrainingState.FORWARD
        self.unshard(self.unshard_async_op)
        self.wait_for_unshard()
        if entering:
            args, kwargs = self._register_post_backward(args, kwargs)
        return args, kwargs

    def post_forward(self) -> None:
        if not _in_backward():  # activation-checkpoint recomputation keeps params for the backward in progress
            if self.reshard_after_forward and self.post_forward_mesh_info is not None:
                self._reshard_post_forward()
            elif self.reshard_after_forward:
                self.reshard()
            if self.post_forward_order is not None and torch.is_grad_enabled():  # a backward may follow
                self._post_forward_indices.append(len(self.post_forward_order))
                self.post_forward_order.append(self)
        self.training_state = TrainingState.IDLE

    def _register_post_backward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not torch.is_grad_enabled():
            return args, kwargs
        leaves, spec = tree_flatten((args, kwargs))
        index = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not index:
            return args, kwargs
        outs = _PostBackward.apply(self, *(leaves[i] for i in index))
        for i, out in zip(index, outs):
            leaves[i] = out
        return tree_unflatten(leaves, spec)

    # -- backward ------------------------------------------------------------------------------------------

    def pre_backward(self, default_prefetch: bool) -> None:
        if self.training_state == TrainingState.PRE_BACKWARD:
            return
        self.training_state = TrainingState.PRE_BACKWARD
        if self.unshard_in_backward:
            self.unshard(self.unshard_async_op)
            self.wait_for_unshard()
        if default_prefetch:
            self._backward_prefetch()

    def _backward_prefetch(self) -> None:
        """Start the all-gather of the group that ran forward just before this one: its backward is next."""
        if not self._post_forward_indices or self.post_forward_order is None:
            return
        index = self._post_forward_indices.pop()
        if index > 0:
            target = self.post_forward_order[index - 1]
            if target.unshard_in_backward:
                target.unshard(async_op=True)

    def post_backward(self) -> None:
        """Reduce this group's gradients (idempotent: a group without gradients does nothing)."""
        self.training_state = TrainingState.POST_BACKWARD
        if not self.reduce_grads:
            if self.reshard_after_backward:
                self.reshard()
            for param in self.params:
                param.keep_unsharded_grad()
            return
        with_grad: list[FSDPParam] = []
        grads: list[torch.Tensor] = []
        for param in self.params:
            grad = param.take_unsharded_grad()
            if grad is None and self.reduce_scatter_unused_params and param.requires_grad:
                grad = torch.zeros(param.local_shape, dtype=param.all_gather_dtype)
            if grad is not None:
                with_grad.append(param)
                grads.append(grad)
        if self.reshard_after_backward:
            self.reshard()
        if with_grad:
            self._partial_reduce = reduce_gradients(
                with_grad, grads, self.mesh_info, self.gradient_divide_factor, self.force_sum_reduction_for_comms,
                self.all_reduce_grads, self._partial_reduce, self.all_reduce_hook, self.reduce_scatter_comm)

    def finalize_backward(self) -> None:
        """End of the last backward of a step: finish stray all-gathers, forget the forward order."""
        if self._gathering is not None:
            self.wait_for_unshard()
        self._post_forward_indices.clear()

    def reset_iter_state(self) -> None:
        """After a failed forward or backward: drop in-flight gradients and return to SHARDED and IDLE."""
        self.reshard()
        for param in self.params:
            param.accumulated_grad = None
            if param._unsharded is not None:
                param._unsharded.grad = None
        self._partial_reduce = None
        self._post_forward_indices.clear()
        self.training_state = TrainingState.IDLE

    # -- state dict ----------------------------------------------------------------------------------------

    def _register_state_dict_hooks(self) -> None:
        """``state_dict()``/``load_state_dict()`` see the sharded DTensors, whatever the group's state."""
        owners = {slot.module for param in self.params for slot in param.slots}

        def to_sharded(*_: Any, **__: Any) -> None:
            self.reshard()

        def refresh(*_: Any, **__: Any) -> None:
            for param in self.params:
                param.refresh_sharded()

        for module in owners:
            module.register_state_dict_pre_hook(to_sharded)
            module._register_load_state_dict_pre_hook(to_sharded)
            module.register_load_state_dict_post_hook(refresh)

    def __repr__(self) -> str:
        return f"FSDPParamGroup({self.fqn or '?'}, {len(self.params)} params)"


class _PostBackward(torch.autograd.Function):
    """Identity on the module's inputs whose backward runs once the module's gradients are all computed.

    Autograd accumulates parameter gradients (AccumulateGrad nodes run first on
    the CPU ready queue) before it hands the inputs' gradients to this node, so
    ``post_backward`` sees the module's complete unsharded gradients.
    """

    @staticmethod
    def forward(ctx: Any, group: FSDPParamGroup, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        ctx.group.post_backward()
        return (None, *grads)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1
