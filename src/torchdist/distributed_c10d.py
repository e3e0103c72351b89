"""``torchdist.distributed_c10d``: the c10d API at PyTorch's module path.

``torch.distributed`` re-exports ``torch.distributed.distributed_c10d``, and some
libraries reach into the latter directly, mostly for a few private helpers
(mmengine calls ``_get_default_group()`` and ``_rank_not_in_group(group)``). This
module gathers the c10d names that torchdist implements, which ``torchdist``
re-exports in turn, and provides those helpers. The functions live in ``_c10d``.
"""

from __future__ import annotations

import warnings

import torch

from ._c10d.collectives import (all_gather, all_gather_coalesced, all_gather_into_tensor, all_gather_single,
                                all_reduce, all_reduce_coalesced, all_to_all, all_to_all_single, barrier, broadcast,
                                gather, reduce, reduce_scatter, reduce_scatter_single, reduce_scatter_tensor, scatter)
from ._c10d.breakpoint import breakpoint
from ._c10d.debug import DebugLevel, get_debug_level
from ._c10d.groups import (get_global_rank, get_group_rank, get_pg_count, get_process_group_ranks, new_group,
                           new_subgroups, new_subgroups_by_enumeration, split_group)
from ._c10d.init import (default_pg_timeout, destroy_process_group, get_backend, get_backend_config,
                         get_node_local_rank, get_rank, get_world_size, init_process_group, is_initialized,
                         is_torchelastic_launched)
from ._c10d.object_collectives import (all_gather_object, broadcast_object_list, gather_object, recv_object_list,
                                       scatter_object_list, send_object_list)
from ._c10d import shrink as _shrink
from ._c10d.shrink import shrink_group
from ._c10d.p2p import P2POp, batch_isend_irecv, irecv, isend, monitored_barrier, recv, send
from ._c10d.world import WORLD, GroupMember, group
from ._process_group import options as _options
from ._process_group.options import (AllreduceCoalescedOptions, AllreduceOptions, AllToAllOptions, BarrierOptions,
                                     BroadcastOptions, GatherOptions, ReduceOptions, ReduceScatterOptions,
                                     ScatterOptions)
from ._c10d.process_group_ops import ProcessGroup
from ._process_group.profiling import record_comm
from ._process_group.reduce_op import ReduceOp, reduce_op, supports_complex
from ._process_group.registry import (Backend, BackendConfig, get_default_backend_for_device, is_backend_available,
                                      is_gloo_available, is_mpi_available, is_nccl_available, is_ucc_available,
                                      is_xccl_available)
from ._process_group.work import Work
from ._store import PrefixStore, Store

__all__ = [
    # stores
    "Store", "PrefixStore",
    # process groups
    "ProcessGroup", "Work", "ReduceOp", "reduce_op", "supports_complex", "Backend", "BackendConfig",
    "is_backend_available", "is_gloo_available", "is_nccl_available", "is_mpi_available", "is_ucc_available",
    "is_xccl_available", "get_default_backend_for_device", "GroupMember", "group", "default_pg_timeout",
    "init_process_group", "destroy_process_group", "is_initialized", "is_torchelastic_launched",
    "get_rank", "get_world_size", "get_backend", "get_backend_config", "get_node_local_rank", "DebugLevel",
    "get_debug_level", "breakpoint", "record_comm",
    "new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group", "shrink_group",
    "get_global_rank", "get_group_rank", "get_pg_count", "get_process_group_ranks",
    # the options of ProcessGroup's op methods (AllgatherOptions is here, not in torch.distributed, as in PyTorch)
    "AllreduceOptions", "AllreduceCoalescedOptions", "AllToAllOptions", "BarrierOptions", "BroadcastOptions",
    "GatherOptions", "ReduceOptions", "ReduceScatterOptions", "ScatterOptions",
    # collectives
    "broadcast", "all_reduce", "all_reduce_coalesced", "reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "all_gather_coalesced", "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    # point to point
    "send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv",
    # object collectives
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
    "send_object_list", "recv_object_list",
]

#: In PyTorch's module, not in its package's names: so here, outside ``__all__``.
AllgatherOptions = _options.AllgatherOptions
#: shrink_group's flags: module attributes outside ``__all__`` in PyTorch too (torch.distributed has neither).
SHRINK_DEFAULT = _shrink.SHRINK_DEFAULT
SHRINK_ABORT = _shrink.SHRINK_ABORT


# -- PyTorch's private helpers that libraries call --------------------------------------------
def _get_default_group() -> ProcessGroup:
    """The default process group; ValueError before ``init_process_group``."""
    return WORLD.require_default()


def _get_default_store() -> Store:
    """The default group's store: the job's store under the group's prefix, as in PyTorch."""
    return _get_default_group().get_group_store()


def _rank_not_in_group(group: ProcessGroup | None) -> bool:
    """Whether ``group`` is what ``new_group`` gave a rank outside it (None is the default group)."""
    return group is not None and group is GroupMember.NON_GROUP_MEMBER


def _get_group_size(group: ProcessGroup | None) -> int:
    return _get_default_group().size() if group is None else group.size()


def _get_global_rank(group: ProcessGroup, rank: int) -> int:
    warnings.warn("`torchdist.distributed_c10d._get_global_rank` is deprecated, please use "
                  "`torchdist.distributed_c10d.get_global_rank` instead", FutureWarning, stacklevel=2)
    return get_global_rank(group, rank)


def _get_process_group_name(pg: ProcessGroup) -> str:
    """A registered group's name; "None" for anything else (None, a non-member's marker, a destroyed group)."""
    name = getattr(pg, "group_name", None)
    return name if name is not None and WORLD.groups.get(name) is pg else "None"


def _get_pg_default_device(group: ProcessGroup | None = None) -> torch.device:
    """The device a group's collectives take: the CPU, for every torchdist backend."""
    warnings.warn("`_get_pg_default_device` will be deprecated, it only stays for backward-compatibility reason: "
                  "torchdist's groups take CPU tensors.", FutureWarning, stacklevel=2)
    return torch.device("cpu")
