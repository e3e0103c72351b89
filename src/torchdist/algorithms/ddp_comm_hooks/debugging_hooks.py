"""``noop_hook``: skips communication entirely, to measure DDP without its all-reduce."""

import torch

from ..._ddp.bucket import GradBucket

__all__ = ["noop_hook"]


def noop_hook(_, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Return the bucket unreduced: each rank keeps its local gradient (a debugging aid)."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut
