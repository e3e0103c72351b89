"""``torchdist.nn``: distributed modules and differentiable collectives. Re-exports only.

As ``torch.nn.parallel`` and ``torch.distributed.nn`` together: DDP, ``RemoteModule``
(a module on another RPC worker, also at ``api.remote_module``) and the
autograd-aware collectives of :mod:`.functional` (``torchdist.nn.all_reduce`` ...).
"""

from . import api, functional, parallel
from .api.remote_module import RemoteModule
from .functional import (all_gather, all_reduce, all_to_all, all_to_all_single, broadcast, gather, reduce,
                         reduce_scatter, scatter)
from .parallel import DistributedDataParallel

__all__ = ["parallel", "DistributedDataParallel", "api", "RemoteModule", "functional", "broadcast", "gather",
           "scatter", "reduce", "reduce_scatter", "all_gather", "all_to_all", "all_to_all_single", "all_reduce"]
