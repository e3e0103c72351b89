"""DDP's machinery under the public front ``torchdist.nn.parallel``: buckets, the Reducer, replica sync.

Layers, top to bottom: ``nn/parallel/distributed.py`` (what users call) ->
``reducer.py`` (autograd hooks, iteration state) -> ``bucket.py`` (bucket
assignment, flat tensors) and ``sync.py`` (shape checks, coalesced broadcasts)
-> the c10d API (``broadcast``, object collectives) and, for the buckets, the
group's backend itself: ``backend.allreduce`` issues an op that is waited on at the
end of backward without being ``async_op=True``, which the c10d API cannot say (see
``reducer.py``). Buckets go into symmetric memory only above the shared-memory
algorithms' one-step size (``_algorithms.shm_direct.SMALL_BYTES``).
"""

from .bucket import Bucket, GradBucket, assign_buckets
from .config import DDPConfig
from .reducer import Reducer

__all__ = ["Bucket", "DDPConfig", "GradBucket", "Reducer", "assign_buckets"]
