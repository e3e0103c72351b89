"""When an FSDP1 unit gathers, frees and reduces its flat parameter within a training step.

Per unit and step (``*``: FULL_SHARD / HYBRID_SHARD only, and never the root)::

    pre-forward      unshard (all-gather), module attributes -> views of the flat parameter
    post-forward     point the flat parameter at its shard again, * freeing the gathered buffer (otherwise
                     kept for backward); hook the outputs' gradients (pre-backward)
    pre-backward     unshard again (all-gather if freed); set the old sharded .grad aside
    post-backward    (after autograd accumulates the flat .grad) reduce-scatter / all-reduce the averaged
                     gradient into a shard; reshard, freeing unless SHARD_GRAD_OP under no_sync
    end of backward  (root's autograd callback, once) give every unit its reduced .grad, reshard leftovers

The units run synchronously, so ``backward_prefetch``, ``forward_prefetch`` and
``limit_all_gathers`` change no result and are accepted as hints.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.variable import Variable
from torch.utils._pytree import tree_flatten, tree_map_only

from .api import ShardingStrategy

if TYPE_CHECKING:
    from .fully_sharded_data_parallel import FullyShardedDataParallel

__all__ = ["TrainingState", "pre_forward", "post_forward", "lazy_init", "reshard_after_forward"]

_FREE_AFTER_FORWARD = (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
_KEEP_AFTER_FORWARD = (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2)


class TrainingState(enum.Enum):
    IDLE = enum.auto()
    FORWARD_BACKWARD = enum.auto()
    SUMMON_FULL_PARAMS = enum.auto()


def lazy_init(unit: FullyShardedDataParallel) -> None:
    """The first unit that runs (forward, state dict, ...) with no root above it becomes the root."""
    if unit._is_root is not None:
        return
    unit._is_root = True
    unit._all_units = type(unit).fsdp_modules(unit)
    for child in unit._all_units[1:]:
        child._is_root = False
    mp = unit.mixed_precision
    if mp is not None and mp.buffer_dtype is not None:  # buffers are cast once, at the root
        ignored = unit._ignored_buffer_ids
        for module in unit.modules():
            for name, buf in module._buffers.items():
                if buf is not None and id(buf) not in ignored and torch.is_floating_point(buf):
                    module._buffers[name] = buf.to(mp.buffer_dtype)


def reshard_after_forward(unit: FullyShardedDataParallel) -> bool:
    return not unit._is_root and unit.sharding_strategy in _FREE_AFTER_FORWARD


def free_in_backward(unit: FullyShardedDataParallel) -> bool:
    """Resharded after backward: always when syncing; under no_sync only the strategies that free after
    forward (SHARD_GRAD_OP keeps the gathered parameters between micro-batches, as PyTorch's heuristic)."""
    return unit._sync_gradients or unit.sharding_strategy in _FREE_AFTER_FORWARD


def pre_forward(unit: FullyShardedDataParallel, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Unshard the unit and cast the inputs (mixed precision)."""
    lazy_init(unit)
    unit.training_state = TrainingState.FORWARD_BACKWARD
    handle = unit._handle
    if handle is not None:
        handle.unshard()
        handle.use_unsharded_views(as_params=False)
    mp = unit.mixed_precision
    if mp is not None and mp.param_dtype is not None and (
            mp.cast_forward_inputs or (unit._is_root and mp.cast_root_forward_inputs)):
        args, kwargs = tree_map_only(torch.Tensor, lambda t: t.to(mp.param_dtype) if torch.is_floating_point(t)
                                     else t, (args, kwargs))
    return args, kwargs


def post_forward(unit: FullyShardedDataParallel, output: Any) -> Any:
    """Free the gathered parameters (FULL_SHARD, non-root) and hook the outputs for the pre-backward."""
    handle = unit._handle
    if handle is not None:
        handle.reshard(free=reshard_after_forward(unit))
        # PyTorch leaves SHARD_GRAD_OP's original parameters unsharded between forward and backward
        if not (handle.use_orig_params and torch.is_grad_enabled() and unit.sharding_strategy in _KEEP_AFTER_FORWARD):
            _show_sharded(handle)
    if torch.is_grad_enabled():
        for tensor in tree_flatten(output)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda grad, unit=unit: _pre_backward(unit, grad))
    unit.training_state = TrainingState.IDLE
    return output


def _pre_backward(unit: FullyShardedDataParallel, grad: torch.Tensor) -> torch.Tensor:
    if unit._ran_pre_backward:
        return grad
    unit._ran_pre_backward = True
    root = unit._root()
    if not root._callback_queued:
        root._callback_queued = True
        Variable._execution_engine.queue_callback(lambda: _post_backward_final(root))
    unit.training_state = TrainingState.FORWARD_BACKWARD
    handle = unit._handle
    if handle is not None:
        handle.unshard()
        handle.prepare_gradient()
        handle.ran_post_backward = False
    return grad


def post_backward(unit: FullyShardedDataParallel) -> None:
    """The flat parameter's gradient is complete: reduce it and reshard (registered as its post-accumulate hook)."""
    handle = unit._handle
    if unit.training_state != TrainingState.FORWARD_BACKWARD or handle.ran_post_backward:
        return
    handle.ran_post_backward = True
    hook, state = unit._comm_hook_of()
    handle.reduce_gradient(unit._sync_gradients, hook, state)
    handle.reshard(free=free_in_backward(unit))
    _show_sharded(handle)


def _post_backward_final(root: FullyShardedDataParallel) -> None:
    """Once per backward, after autograd finishes: hand out the reduced gradients and reset the units."""
    root._callback_queued = False
    for unit in root._all_units:
        handle = unit._handle
        if handle is not None:
            handle.reshard(free=free_in_backward(unit) and (not unit._is_root or handle.ran_post_backward))
            _show_sharded(handle)
            handle.finalize_gradient()
        unit._ran_pre_backward = False
        unit.training_state = TrainingState.IDLE


def _show_sharded(handle) -> None:
    """Outside forward the modules show their sharded form. With ``use_orig_params`` that means the original
    ``nn.Parameter`` objects (views of the shard) back in ``_parameters`` even when the gathered buffer is kept
    (the root, SHARD_GRAD_OP under no_sync, NO_SHARD): the plain views forward used are gone, and ``.grad`` set
    at the end of backward lands on parameters the user can see (as in PyTorch)."""
    if handle.use_orig_params or not handle.unsharded:
        handle.use_sharded_views()
