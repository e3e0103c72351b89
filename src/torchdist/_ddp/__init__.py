"""DDP's machinery under the public front ``torchdist.nn.parallel``: buckets, the Reducer, replica sync.

Layers, top to bottom: ``nn/parallel/distributed.py`` (what users call) ->
``reducer.py`` (autograd hooks, iteration state) -> ``bucket.py`` (bucket
assignment, flat tensors) and ``sync.py`` (shape checks, coalesced broadcasts)
-> the c10d API (``all_reduce``/``broadcast`` with ``async_op``).
"""

from .bucket import Bucket, GradBucket, assign_buckets
from .config import DDPConfig
from .reducer import Reducer

__all__ = ["Bucket", "DDPConfig", "GradBucket", "Reducer", "assign_buckets"]
