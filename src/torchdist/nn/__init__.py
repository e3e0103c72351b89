"""``torchdist.nn``: distributed modules. Re-exports only."""

from . import parallel
from .parallel import DistributedDataParallel

__all__ = ["parallel", "DistributedDataParallel"]
