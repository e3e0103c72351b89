"""torchdist: PyTorch Distributed written from scratch in Python.

This module only re-exports: ``import torchdist as dist`` gives the names of
``torch.distributed``. See README.md for a tour of the layers.
"""

from .errors import DistBackendError, DistError, DistNetworkError, DistStoreError, QueueEmptyError
from ._store import FileStore, HashStore, TCPStore
from ._store.rendezvous import register_rendezvous_handler, rendezvous
from ._process_group.reduce_op import _make_nccl_premul_sum
from ._c10d.debug import set_debug_level, set_debug_level_from_env
from ._c10d.init import is_available
from . import distributed_c10d
from .distributed_c10d import *  # noqa: F403 - the c10d API, re-exported as torch.distributed does
from ._ddp.bucket import GradBucket
from .nn.parallel import DistributedDataParallel
from .algorithms.ddp_comm_hooks import BuiltinCommHookType
from .utils.data import DistributedSampler
from . import algorithms, autograd, device_mesh, nn, optim, rpc, symmetric_memory, utils
from .device_mesh import DeviceMesh, init_device_mesh

__all__ = [
    # errors
    "DistError", "DistBackendError", "DistNetworkError", "DistStoreError", "QueueEmptyError",
    # stores and rendezvous beside the c10d API's Store and PrefixStore
    "HashStore", "FileStore", "TCPStore", "rendezvous", "register_rendezvous_handler",
    "is_available", "set_debug_level", "set_debug_level_from_env",
    # process groups, collectives, point to point, object collectives: torch.distributed.distributed_c10d
    *distributed_c10d.__all__, "distributed_c10d",
    # data parallel
    "BuiltinCommHookType", "DistributedDataParallel", "DistributedSampler", "GradBucket",
    # device meshes, re-exported at the top as torch.distributed does
    "DeviceMesh", "init_device_mesh",
    # subpackages: torch.distributed.{algorithms, autograd, device_mesh, optim, rpc}, torch.nn, torch.utils.data
    "algorithms", "autograd", "device_mesh", "nn", "optim", "rpc", "utils",
]
