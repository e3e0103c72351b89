"""``torchdist.fsdp``: PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``) on CPU meshes.

Modules: ``_api`` (policies, the communication interfaces), ``_mesh_info`` (which mesh dim shards),
``_dtensor`` (the DTensor calls), ``_param`` (one parameter's shard geometry and
forms), ``_collectives`` (flat all-gather and reduce-scatter),
``_param_group`` (when a group gathers, frees and reduces), ``_state`` (the
module hooks and the root's per-step duties), ``_fully_shard`` (the API).
"""

from ._api import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from ._fully_shard import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method, share_comm_ctx

__all__ = [
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
