"""The configuration vocabulary of FSDP1 (``torch.distributed.fsdp.api``): sharding strategies, prefetch modes,
mixed precision, CPU offload and the state-dict types with their configs.

Field names, defaults and enum members are PyTorch 2.13's, so that programs can
build and compare them exactly as they do with torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto

import torch
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = [
    "ShardingStrategy",
    "BackwardPrefetch",
    "MixedPrecision",
    "CPUOffload",
    "StateDictType",
    "StateDictConfig",
    "FullStateDictConfig",
    "LocalStateDictConfig",
    "ShardedStateDictConfig",
    "OptimStateDictConfig",
    "FullOptimStateDictConfig",
    "LocalOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "StateDictSettings",
    "OptimStateKeyType",
]


class ShardingStrategy(Enum):
    """What a unit shards and when it frees its gathered parameters.

    - FULL_SHARD: parameters, gradients and optimizer state sharded; gathered
      parameters freed after forward (except the root's) and after backward.
    - SHARD_GRAD_OP: as FULL_SHARD but kept gathered from forward to the end of
      backward (one all-gather per step instead of two).
    - NO_SHARD: replicated as in DDP; gradients all-reduced.
    - HYBRID_SHARD / _HYBRID_SHARD_ZERO2: FULL_SHARD / SHARD_GRAD_OP within a
      shard group, replicated (gradients all-reduced) across a replicate group.
    """

    FULL_SHARD = auto()
    SHARD_GRAD_OP = auto()
    NO_SHARD = auto()
    HYBRID_SHARD = auto()
    _HYBRID_SHARD_ZERO2 = auto()


class BackwardPrefetch(Enum):
    """When the next unit's all-gather is issued in backward (a scheduling hint: results do not depend on it)."""

    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()


@dataclass
class MixedPrecision:
    """Dtypes for the gathered parameters (``param_dtype``), the gradient reduction (``reduce_dtype``) and the
    buffers (``buffer_dtype``); ``None`` keeps the original dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[type[torch.nn.Module]] = (_BatchNorm,)


@dataclass
class CPUOffload:
    """Keep the sharded parameters and gradients on CPU (torchdist's parameters always are)."""

    offload_params: bool = False


class StateDictType(Enum):
    """What ``state_dict()`` returns: full tensors, the local flat shards, or per-parameter shards."""

    FULL_STATE_DICT = auto()
    LOCAL_STATE_DICT = auto()
    SHARDED_STATE_DICT = auto()


@dataclass
class StateDictConfig:
    """Base of the model state-dict configs; ``offload_to_cpu`` moves the values to CPU."""

    offload_to_cpu: bool = False


@dataclass
class FullStateDictConfig(StateDictConfig):
    """``rank0_only``: only rank 0 gathers the sharded units' parameters; other ranks return only the entries of
    NO_SHARD units (whole everywhere), as PyTorch does."""

    rank0_only: bool = False


@dataclass
class LocalStateDictConfig(StateDictConfig):
    pass


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    _use_dtensor: bool = False


@dataclass
class OptimStateDictConfig:
    """Base of the optimizer state-dict configs (offloaded to CPU by default, as in PyTorch)."""

    offload_to_cpu: bool = True


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    rank0_only: bool = False


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    offload_to_cpu: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    _use_dtensor: bool = False


@dataclass
class StateDictSettings:
    """What ``state_dict_type`` set on a module: the type and both configs."""

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig


class OptimStateKeyType(Enum):
    """The keys of an optimizer state dict: parameter names or parameter ids."""

    PARAM_NAME = auto()
    PARAM_ID = auto()
