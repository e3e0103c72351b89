"""``torchdist.fsdp``: PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``) on CPU meshes.

Modules: ``_api`` (policies, the communication interfaces), ``_mesh_info`` (which mesh dim shards),
``_dtensor`` (the DTensor calls), ``_param`` (one parameter's shard geometry and
forms), ``_collectives`` (flat all-gather and reduce-scatter),
``_param_group`` (when a group gathers, frees and reduces), ``_state`` (the
module hooks and the root's per-step duties), ``_fully_shard`` (the API).

FSDP1 (``FullyShardedDataParallel``): ``api`` (strategies and configs), ``wrap``
(auto-wrap policies), ``_flat_param`` (the flat parameter and its handle),
``_fsdp1_runtime`` (gather / free / reduce), ``_fsdp1_state_dict``,
``_fsdp1_optim``, ``fully_sharded_data_parallel`` (the wrapper class).
"""

from ._api import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from ._fully_shard import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method, share_comm_ctx
from .api import (BackwardPrefetch, CPUOffload, FullOptimStateDictConfig, FullStateDictConfig,
                  LocalOptimStateDictConfig, LocalStateDictConfig, MixedPrecision, OptimStateDictConfig,
                  OptimStateKeyType, ShardedOptimStateDictConfig, ShardedStateDictConfig, ShardingStrategy,
                  StateDictConfig, StateDictSettings, StateDictType)
from .fully_sharded_data_parallel import FullyShardedDataParallel

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
]
