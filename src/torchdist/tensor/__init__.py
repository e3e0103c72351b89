"""``torchdist.tensor``: DTensor, PyTorch's ``torch.distributed.tensor``.

Modules: ``_placements`` (Shard, Replicate, Partial), ``_spec`` (layout and
shape arithmetic), ``_redistribute`` (placement changes as collectives),
``_api`` (the DTensor class and its differentiable conversions),
``_dispatch`` with ``_ops/`` (sharding propagation of aten ops) and ``_special``
(ops answered directly), ``_strided`` (ops on FSDP + TP's ``_StridedShard``
layouts), ``_distribute`` and ``_factories`` (ways to make DTensors); ``_utils``
and ``placement_types`` keep PyTorch's module paths; ``experimental`` holds
``implicit_replication``, ``local_map`` and ``register_sharding``.
See docs/design/dtensor.md.
"""

from ..device_mesh import DeviceMesh, init_device_mesh
from ._api import DTensor
from ._distribute import distribute_module, distribute_tensor
from ._factories import empty, full, ones, rand, randn, zeros
from ._placements import Partial, Placement, Replicate, Shard, _StridedShard

__all__ = [
    "DTensor", "distribute_tensor", "distribute_module", "Shard", "Replicate", "Partial", "Placement",
    "ones", "empty", "full", "rand", "randn", "zeros"
]
# PyTorch's module also offers the mesh names and _StridedShard (FSDP + TP's placement), outside __all__.
_PRIVATE_NAMES = (DeviceMesh, init_device_mesh, _StridedShard)
