"""``torchdist.tensor.placement_types``: PyTorch's module path of the placement classes."""

from ._placements import Partial, Placement, Replicate, Shard, _StridedShard

__all__ = ["Placement", "Shard", "Replicate", "Partial"]
_PRIVATE_NAMES = (_StridedShard,)  # importable from here, outside __all__, as in PyTorch
