"""``torchdist.algorithms.ddp_comm_hooks``: communication hooks for DDP (PyTorch's module of that name).

Register one with ``ddp_model.register_comm_hook(state, hook)``, or by type with
``register_ddp_comm_hook(DDPCommHookType.FP16_COMPRESS, ddp_model)``.
PyTorch's quantization hooks and post-local-SGD are not provided (see
docs/design/ddp.md).
"""

import enum

from . import debugging_hooks, default_hooks, powerSGD_hook
from .default_hooks import (
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
)
from .powerSGD_hook import PowerSGDState, batched_powerSGD_hook

__all__ = [
    "BuiltinCommHookType", "DDPCommHookType", "register_ddp_comm_hook", "default_hooks", "powerSGD_hook", "debugging_hooks",
    "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "fp16_compress_wrapper", "bf16_compress_wrapper",
    "PowerSGDState", "batched_powerSGD_hook",
]


class BuiltinCommHookType(enum.Enum):
    """The hooks PyTorch's reducer runs natively (``DDP._register_builtin_comm_hook``);
    here they are the Python ones of the same name."""

    ALLREDUCE = 0
    FP16_COMPRESS = 1


class DDPCommHookType(enum.Enum):
    """The built-in hooks, by name (``register_ddp_comm_hook``)."""

    ALLREDUCE = "allreduce"
    FP16_COMPRESS = "fp16_compress"
    BF16_COMPRESS = "bf16_compress"
    POWER_SGD = "power_sgd"
    POWER_SGD_RANK2 = "power_sgd_rank2"
    BATCHED_POWER_SGD = "batched_power_sgd"
    BATCHED_POWER_SGD_RANK2 = "batched_power_sgd_rank2"
    NOOP = "noop"


_SIMPLE = {
    DDPCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
    DDPCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook,
    DDPCommHookType.BF16_COMPRESS: default_hooks.bf16_compress_hook,
    DDPCommHookType.NOOP: debugging_hooks.noop_hook,
}
_POWER_SGD = {
    DDPCommHookType.POWER_SGD: (powerSGD_hook.powerSGD_hook, 1),
    DDPCommHookType.POWER_SGD_RANK2: (powerSGD_hook.powerSGD_hook, 2),
    DDPCommHookType.BATCHED_POWER_SGD: (powerSGD_hook.batched_powerSGD_hook, 1),
    DDPCommHookType.BATCHED_POWER_SGD_RANK2: (powerSGD_hook.batched_powerSGD_hook, 2),
}


def register_ddp_comm_hook(comm_hook_type: DDPCommHookType, model, state=None) -> None:
    """Register the built-in hook ``comm_hook_type`` on DDP ``model``; ``state`` is the process group."""
    if comm_hook_type in _SIMPLE:
        model.register_comm_hook(state, _SIMPLE[comm_hook_type])
        return
    if comm_hook_type not in _POWER_SGD:
        raise ValueError(f"unknown DDP comm hook type {comm_hook_type!r}; expected one of "
                         f"{[t.name for t in DDPCommHookType]}")
    hook, rank = _POWER_SGD[comm_hook_type]
    model.register_comm_hook(PowerSGDState(process_group=state, matrix_approximation_rank=rank), hook)
