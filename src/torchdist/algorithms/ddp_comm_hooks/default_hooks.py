"""The basic DDP communication hooks: plain all-reduce and fp16/bf16 compression.

A hook takes ``(state, bucket)`` and returns a ``torch.futures.Future`` whose
value is the bucket's reduced (averaged) flat gradient. With no hook registered,
DDP runs the equivalent of :func:`allreduce_hook` itself. The compression hooks
halve the bytes on the wire by all-reducing a 16-bit copy of the bucket and
casting the result back (Agarwal et al., "On the Utility of Gradient
Compression in Distributed Training Systems", MLSys 2022, measure when it pays).

Here ``state`` is the process group to use (``None``: the default group).
"""

from typing import Any, Callable

import torch

from ..._c10d.collectives import all_reduce
from ..._c10d.world import WORLD
from ..._ddp.bucket import GradBucket

__all__ = ["allreduce_hook", "bf16_compress_hook", "bf16_compress_wrapper", "fp16_compress_hook",
           "fp16_compress_wrapper"]


def _group(process_group):
    return process_group if process_group is not None else WORLD.require_default()


def _allreduce_fut(process_group, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """Average ``tensor`` in place across the group; the future's value is ``tensor``."""
    group = _group(process_group)
    tensor.div_(group.size())
    return all_reduce(tensor, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def allreduce_hook(process_group, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket, averaged: what DDP does without a hook."""
    return _allreduce_fut(process_group, bucket.buffer())


def _compress_hook(dtype: torch.dtype, process_group, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    group = _group(process_group)
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(group.size())

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])  # in place, to keep the peak memory down
        return buffer

    return all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def fp16_compress_hook(process_group, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket as float16, averaged, and cast the result back."""
    return _compress_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket as bfloat16, averaged, and cast the result back."""
    return _compress_hook(torch.bfloat16, process_group, bucket)


def _compress_wrapper(dtype: torch.dtype, hook: Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]):
    def wrapper_hook(hook_state, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        original = bucket.buffer()
        bucket.set_buffer(original.to(dtype))
        fut = hook(hook_state, bucket)

        def decompress(fut: torch.futures.Future) -> torch.Tensor:
            value = fut.value()
            original.copy_(value[0] if isinstance(value, (list, tuple)) else value)
            return original

        return fut.then(decompress)
    return wrapper_hook


def fp16_compress_wrapper(hook):
    """Wrap ``hook`` so that it runs on a float16 copy of the bucket (e.g. PowerSGD in fp16)."""
    wrapped = _compress_wrapper(torch.float16, hook)
    wrapped.__name__ = "fp16_compress_wrapper_hook"
    return wrapped


def bf16_compress_wrapper(hook):
    """Wrap ``hook`` so that it runs on a bfloat16 copy of the bucket."""
    wrapped = _compress_wrapper(torch.bfloat16, hook)
    wrapped.__name__ = "bf16_compress_wrapper_hook"
    return wrapped
