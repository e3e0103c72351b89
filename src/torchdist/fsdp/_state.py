"""The hooks of one ``fully_shard`` call on its module(s), and what the root of a model does once per step.

The first FSDP module to run forward becomes the *root* (PyTorch's rule): at its
first forward it finds every FSDP module below it, shares one per-step context
with them (the forward order, for backward prefetching) and, unless the user
chose ``reshard_after_forward``, keeps its own parameters unsharded after
forward because backward needs them at once. The root also queues one
autograd-engine callback per backward, which runs ``post_backward`` for every
group that autograd did not reach (a module whose inputs did not require
gradients, such as the root) and resets the per-step state.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.autograd.variable import Variable
from torch.utils._pytree import tree_flatten, tree_map_only

from ._api import MixedPrecisionPolicy
from ._param_group import FSDPParamGroup, TrainingState

__all__ = ["FSDPState", "state_of"]

_STATE_ATTR = "_torchdist_fsdp_state"


@dataclass
class _StepContext:
    """Per-step state shared by all FSDP states under one root."""

    states: list[FSDPState] = field(default_factory=list)
    callback_queued: bool = False
    is_last_backward: bool = True
    post_forward_order: list[FSDPParamGroup] = field(default_factory=list)


class FSDPState:
    """Forward pre/post hooks of one ``fully_shard`` call, its parameter group (None without parameters) and the
    root-only duties described in the module docstring."""

    def __init__(self, modules: tuple[nn.Module, ...], mp_policy: MixedPrecisionPolicy,
                 auto_reshard_after_forward: bool) -> None:
        self.modules = modules
        self.mp_policy = mp_policy
        self.auto_reshard_after_forward = auto_reshard_after_forward
        self.param_group: FSDPParamGroup | None = None
        self.is_root: bool | None = None
        self.training_state = TrainingState.IDLE
        self.ctx = _StepContext()
        self.forward_prefetch: list[FSDPState] = []
        self.backward_prefetch: list[FSDPState] = []
        self._modules_to_run: set[nn.Module] = set()
        for module in modules:
            module.__dict__[_STATE_ATTR] = self
            module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(self._post_forward, prepend=False)

    @property
    def groups(self) -> list[FSDPParamGroup]:
        return [] if self.param_group is None else [self.param_group]

    # -- root ------------------------------------------------------------------------------------------------

    def lazy_init(self) -> None:
        """Make this state the root of everything below its module (once), as described in the module docstring."""
        if self.is_root is not None:
            return
        if len(self.modules) > 1:
            raise RuntimeError(f"FSDP requires a single root module but got {list(self.modules)}: call fully_shard "
                               "on the model's top module too, and run forward through it")
        self.is_root = True
        root = self.modules[0]
        states: list[FSDPState] = []
        for name, module in root.named_modules():
            state = state_of(module)
            if state is None or state in states:
                continue
            if state is not self:
                if state.is_root is not None:
                    raise RuntimeError(f"FSDP state has already been lazily initialized for {name}\nFSDP requires "
                                       "running forward through the root module first")
                state.is_root = False
            for group in state.groups:
                group.fqn = name
                group.post_forward_order = self.ctx.post_forward_order
            states.append(state)
        if self.auto_reshard_after_forward and self.param_group is not None:
            self.param_group.reshard_after_forward = False  # backward needs the root's parameters first
        self.ctx.states = states
        for state in states:
            state.ctx = self.ctx

    # -- forward hooks -----------------------------------------------------------------------------------------

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.training_state == TrainingState.PRE_BACKWARD:  # activation checkpointing recomputes forward
            for group in self.groups:
                group.unshard()
                group.wait_for_unshard()
            return self._cast_inputs(args, kwargs)
        first_module = self.training_state != TrainingState.FORWARD
        self.training_state = TrainingState.FORWARD
        if first_module:
            self.lazy_init()
            self._modules_to_run = set(self.modules)
        args, kwargs = self._cast_inputs(args, kwargs)
        for group in self.groups:
            args, kwargs = group.pre_forward(args, kwargs)
        if first_module:
            for state in self.forward_prefetch:
                for group in state.groups:
                    group.unshard(async_op=True)
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.training_state == TrainingState.PRE_BACKWARD:
            return self._cast_output(output)
        self._modules_to_run.discard(module)
        if self._modules_to_run:  # a grouped fully_shard([a, b]): wait for the group's last module
            return self._cast_output(output)
        for group in self.groups:
            group.post_forward()
        output = self._register_pre_backward(output)
        self.training_state = TrainingState.IDLE
        return self._cast_output(output)

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        dtype = self.mp_policy.param_dtype
        if not (self.mp_policy.cast_forward_inputs and dtype):
            return args, kwargs
        return _cast_floats((args, kwargs), dtype)

    def _cast_output(self, output: Any) -> Any:
        dtype = self.mp_policy.output_dtype
        return output if dtype is None else _cast_floats(output, dtype)

    # -- backward hooks ----------------------------------------------------------------------------------------

    def _register_pre_backward(self, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return output
        for tensor in tree_flatten(output)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                if tensor._base is not None:
                    names = ", ".join(type(m).__name__ for m in self.modules)
                    warnings.warn(f"FSDP2-wrapped module ({names}) returned a view tensor. An in-place op on this "
                                  "view (e.g., `x += y`) will silently drop the pre-backward hook and skip the "
                                  "all-gather, which can cause backward to fail or produce wrong gradients. Use "
                                  "out-of-place ops (`out = out + y`, not `out += y`) or `.clone()` the output "
                                  "before any in-place op.", UserWarning, stacklevel=2)
                tensor.register_hook(self._pre_backward)
        return output

    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        self.training_state = TrainingState.PRE_BACKWARD
        self._queue_final_callback()
        for group in self.groups:
            group.pre_backward(default_prefetch=not self.backward_prefetch)
        for state in self.backward_prefetch:
            for group in state.groups:
                if group.unshard_in_backward:
                    group.unshard(async_op=True)
        return grad

    def _queue_final_callback(self) -> None:
        if self.ctx.callback_queued:
            return
        self.ctx.callback_queued = True
        Variable._execution_engine.queue_callback(self._root_post_backward)  # any state: they share ``ctx``

    def _root_post_backward(self) -> None:
        """End of backward: reduce what autograd did not reach, reset per-step state."""
        ctx = self.ctx
        for state in ctx.states or [self]:
            state._modules_to_run.clear()
            for group in state.groups:
                if group.training_state != TrainingState.POST_BACKWARD:
                    group.post_backward()  # e.g. the root: its inputs need no gradient, so autograd never called it
                group.training_state = TrainingState.IDLE
                if ctx.is_last_backward:
                    group.finalize_backward()
            state.training_state = TrainingState.IDLE
        if ctx.is_last_backward:
            ctx.post_forward_order.clear()
        ctx.callback_queued = False

    def reset_iter_state(self) -> None:
        if self.is_root is False:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")
        for state in self.ctx.states or [self]:
            state._modules_to_run.clear()
            state.training_state = TrainingState.IDLE
            for group in state.groups:
                group.reset_iter_state()
        self.ctx.post_forward_order.clear()
        self.ctx.callback_queued = False


def state_of(module: nn.Module) -> FSDPState | None:
    """The FSDP state ``fully_shard`` attached to ``module``, if any."""
    return module.__dict__.get(_STATE_ATTR)


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)
