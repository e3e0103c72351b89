"""torchdist: PyTorch Distributed written from scratch in Python.

This module only re-exports: ``import torchdist as dist`` gives the names of
``torch.distributed``. See README.md for a tour of the layers.
"""

from .errors import DistBackendError, DistError, DistNetworkError, DistStoreError, QueueEmptyError
from ._store import FileStore, HashStore, PrefixStore, Store, TCPStore
from ._store.rendezvous import register_rendezvous_handler, rendezvous
from ._process_group.process_group import ProcessGroup
from ._process_group.reduce_op import ReduceOp, _make_nccl_premul_sum, reduce_op, supports_complex
from ._process_group.registry import (Backend, BackendConfig, get_default_backend_for_device, is_backend_available,
                                      is_gloo_available, is_mpi_available, is_nccl_available, is_ucc_available,
                                      is_xccl_available)
from ._process_group.work import Work
from ._c10d.world import GroupMember, group
from ._c10d.debug import DebugLevel, get_debug_level, set_debug_level, set_debug_level_from_env
from ._c10d.init import (
    default_pg_timeout,
    destroy_process_group,
    get_backend,
    get_node_local_rank,
    get_rank,
    get_world_size,
    init_process_group,
    is_available,
    is_initialized,
    is_torchelastic_launched,
)
from ._c10d.groups import (
    get_global_rank,
    get_group_rank,
    get_pg_count,
    get_process_group_ranks,
    new_group,
    new_subgroups,
    new_subgroups_by_enumeration,
    split_group,
)
from ._c10d.collectives import (
    all_gather,
    all_gather_coalesced,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    all_reduce_coalesced,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
    scatter,
)
from ._c10d.p2p import P2POp, batch_isend_irecv, irecv, isend, monitored_barrier, recv, send
from ._ddp.bucket import GradBucket
from .nn.parallel import DistributedDataParallel
from .algorithms.ddp_comm_hooks import BuiltinCommHookType
from .utils.data import DistributedSampler
from . import algorithms, autograd, nn, optim, rpc, symmetric_memory, utils
from ._c10d.object_collectives import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)

__all__ = [
    # errors
    "DistError", "DistBackendError", "DistNetworkError", "DistStoreError", "QueueEmptyError",
    # stores and rendezvous
    "Store", "HashStore", "FileStore", "TCPStore", "PrefixStore", "rendezvous", "register_rendezvous_handler",
    # process groups
    "ProcessGroup", "Work", "ReduceOp", "reduce_op", "supports_complex", "Backend", "BackendConfig",
    "is_backend_available", "is_gloo_available", "is_nccl_available", "is_mpi_available", "is_ucc_available",
    "is_xccl_available", "get_default_backend_for_device", "GroupMember", "group", "default_pg_timeout",
    "init_process_group", "destroy_process_group", "is_available", "is_initialized", "is_torchelastic_launched",
    "get_rank", "get_world_size", "get_backend", "get_node_local_rank",
    "DebugLevel", "get_debug_level", "set_debug_level", "set_debug_level_from_env",
    "new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group",
    "get_global_rank", "get_group_rank", "get_pg_count", "get_process_group_ranks",
    # collectives
    "broadcast", "all_reduce", "all_reduce_coalesced", "reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "all_gather_coalesced", "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    # point to point
    "send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv",
    # object collectives
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
    "send_object_list", "recv_object_list",
    # data parallel
    "BuiltinCommHookType", "DistributedDataParallel", "DistributedSampler", "GradBucket",
    # subpackages: torch.distributed.{algorithms, autograd, optim, rpc}, torch.nn, torch.utils.data
    "algorithms", "autograd", "nn", "optim", "rpc", "utils",
]
