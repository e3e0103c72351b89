"""``torchdist.utils.data``: ``DistributedSampler`` (``torch.utils.data.distributed``'s). Re-exports only."""

from .distributed import DistributedSampler

__all__ = ["DistributedSampler"]
