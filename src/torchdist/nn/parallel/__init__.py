"""``torchdist.nn.parallel``: ``DistributedDataParallel`` (``torch.nn.parallel``'s). Re-exports only."""

from .distributed import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
