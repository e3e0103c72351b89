"""``torchdist.tensor.placement_types``: PyTorch's module path of the placement classes."""

from ._placements import Partial, Placement, Replicate, Shard

__all__ = ["Placement", "Shard", "Replicate", "Partial"]
