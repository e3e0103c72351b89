"""``torchdist.algorithms.ddp_comm_hooks``: communication hooks for DDP (PyTorch's module of that name).

Register one with ``ddp_model.register_comm_hook(state, hook)``, or by type with
``register_ddp_comm_hook(DDPCommHookType.FP16_COMPRESS, ddp_model)``.
Post-local SGD is the submodule ``post_localSGD_hook`` (with
``torchdist.algorithms.model_averaging``), and the ZeroRedundancyOptimizer overlap
hooks the submodule ``ddp_zero_hook``, imported by name as in PyTorch (it is not
imported here). Not provided: the CUDA-stream mixed-precision hook and the
optimizer-overlap hooks (see docs/design/ddp.md).
"""

import enum
from functools import partial

from . import debugging_hooks, default_hooks, powerSGD_hook, quantization_hooks
from .default_hooks import (
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
)
from .powerSGD_hook import PowerSGDState, batched_powerSGD_hook
from .quantization_hooks import quantization_perchannel_hook, quantization_pertensor_hook

# PyTorch's short names too
debugging, default, powerSGD, quantization = debugging_hooks, default_hooks, powerSGD_hook, quantization_hooks

__all__ = [
    "BuiltinCommHookType", "DDPCommHookType", "register_ddp_comm_hook", "default_hooks", "powerSGD_hook",
    "debugging_hooks", "quantization_hooks", "debugging", "default", "powerSGD", "quantization", "allreduce_hook",
    "fp16_compress_hook", "bf16_compress_hook", "fp16_compress_wrapper", "bf16_compress_wrapper", "PowerSGDState",
    "batched_powerSGD_hook", "quantization_pertensor_hook", "quantization_perchannel_hook",
]


class BuiltinCommHookType(enum.Enum):
    """The hooks PyTorch's reducer runs natively (``DDP._register_builtin_comm_hook``);
    here they are the Python ones of the same name."""

    ALLREDUCE = 0
    FP16_COMPRESS = 1


def _ddp_comm_hook_wrapper(comm_hook, model, state) -> None:
    model.register_comm_hook(state, comm_hook)


def _powerSGD_comm_hook_wrapper(comm_hook, model, state, matrix_approximation_rank: int,
                                start_powerSGD_iter: int = 1_000) -> None:
    """PowerSGD by type: ``state`` is the process group, as for the other types."""
    powerSGD_state = PowerSGDState(process_group=state, matrix_approximation_rank=matrix_approximation_rank,
                                   start_powerSGD_iter=start_powerSGD_iter)
    model.register_comm_hook(powerSGD_state, comm_hook)


# A partial is an Enum member only when wrapped (Python 3.13 warns, later ones will make it
# a method); enum.member is new in 3.11, and 3.10 takes a bare partial as a member.
_member = getattr(enum, "member", lambda value: value)


class DDPCommHookType(enum.Enum):
    """The built-in hooks by name; as in PyTorch, each value registers its hook when called:
    ``DDPCommHookType.FP16_COMPRESS.value(model=ddp_model, state=process_group)``."""

    ALLREDUCE = _member(partial(_ddp_comm_hook_wrapper, comm_hook=default_hooks.allreduce_hook))
    FP16_COMPRESS = _member(partial(_ddp_comm_hook_wrapper, comm_hook=default_hooks.fp16_compress_hook))
    BF16_COMPRESS = _member(partial(_ddp_comm_hook_wrapper, comm_hook=default_hooks.bf16_compress_hook))
    QUANTIZE_PER_TENSOR = _member(partial(_ddp_comm_hook_wrapper,
                                          comm_hook=quantization_hooks.quantization_pertensor_hook))
    QUANTIZE_PER_CHANNEL = _member(partial(_ddp_comm_hook_wrapper,
                                           comm_hook=quantization_hooks.quantization_perchannel_hook))
    POWER_SGD = _member(partial(_powerSGD_comm_hook_wrapper, comm_hook=powerSGD_hook.powerSGD_hook,
                                matrix_approximation_rank=1))
    POWER_SGD_RANK2 = _member(partial(_powerSGD_comm_hook_wrapper, comm_hook=powerSGD_hook.powerSGD_hook,
                                      matrix_approximation_rank=2))
    BATCHED_POWER_SGD = _member(partial(_powerSGD_comm_hook_wrapper, comm_hook=powerSGD_hook.batched_powerSGD_hook,
                                        matrix_approximation_rank=1))
    BATCHED_POWER_SGD_RANK2 = _member(partial(_powerSGD_comm_hook_wrapper,
                                              comm_hook=powerSGD_hook.batched_powerSGD_hook,
                                              matrix_approximation_rank=2))
    NOOP = _member(partial(_ddp_comm_hook_wrapper, comm_hook=debugging_hooks.noop_hook))


def register_ddp_comm_hook(comm_hook_type: DDPCommHookType, model, state=None) -> None:
    """Register the built-in hook ``comm_hook_type`` on DDP ``model``; ``state`` is the process group."""
    if not isinstance(comm_hook_type, DDPCommHookType):
        raise ValueError(f"unknown DDP comm hook type {comm_hook_type!r}; expected one of "
                         f"{[t.name for t in DDPCommHookType]}")
    comm_hook_type.value(model=model, state=state)
