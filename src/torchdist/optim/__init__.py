"""``torchdist.optim``: distributed optimizers (``torch.distributed.optim``'s API). Re-exports only."""

from .distributed_optimizer import DistributedOptimizer
from .post_localSGD_optimizer import PostLocalSGDOptimizer
from .zero_redundancy_optimizer import ZeroRedundancyOptimizer

__all__ = ["DistributedOptimizer", "PostLocalSGDOptimizer", "ZeroRedundancyOptimizer"]
