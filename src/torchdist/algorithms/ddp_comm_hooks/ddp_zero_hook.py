"""ZeroRedundancyOptimizer's step inside DDP's communication hook (PyTorch's ``ddp_zero_hook``).

A ``ZeroRedundancyOptimizer(..., overlap_with_ddp=True)`` does not step in
``step()``: these wrappers of a comm hook (usually ``allreduce_hook``) step it
bucket by bucket during backward, once a bucket's all-reduce is done, and
broadcast each updated piece from the rank that owns it::

    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))

The parameters are partitioned by DDP bucket, so the partition waits for DDP's
bucket rebuild (``ddp._has_rebuilt_buckets``): the iteration after it records
each bucket's parameters, and the first bucket of the next one initializes the
optimizer. Until then the hook only all-reduces, so the first two iterations
(three with ``static_graph``) update nothing, as in PyTorch. With
``find_unused_parameters`` (and no ``static_graph``) DDP never rebuilds its
buckets and the parameters are never updated, as in PyTorch; torchdist warns.

The two schedules, for buckets 0..n-1 (``AR``: a bucket's all-reduce, ``BC``: the
broadcasts of its updated parameters)::

    hook_with_zero_step:              AR0 AR1 ... AR(n-1) | step0 BC0 | step1 BC1 | ... (in the last hook)
    hook_with_zero_step_interleaved:  AR0 AR1 | step0 BC0 | AR2 | step1 BC1 | ... AR(n-1) | step(n-2) BC(n-2) |
                                      step(n-1) BC(n-1)

PyTorch refuses both on gloo ("Gloo backend using Overlapping DDP with ZeRO may
meet hangs", pytorch#62300): its interleaved hook issues the broadcasts from the
all-reduce futures' callbacks, on whichever thread completes them, so ranks issue
them in different orders (it hangs on gloo: checked with torch 2.13). torchdist
runs every step and broadcast on the thread running backward, bucket ``i - 1``'s
in the hook of bucket ``i`` (one bucket behind, so the step overlaps bucket
``i``'s all-reduce), and every rank issues the same collectives in the same
order on every backend; so it accepts every backend.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..._c10d.collectives import broadcast
from ..._ddp.bucket import GradBucket
from ...optim.zero_redundancy_optimizer import _OverlapStatus

if TYPE_CHECKING:
    from ...nn.parallel.distributed import DistributedDataParallel
    from ...optim.zero_redundancy_optimizer import ZeroRedundancyOptimizer

__all__ = ["hook_with_zero_step", "hook_with_zero_step_interleaved"]

logger = logging.getLogger(__name__)

_Hook = Callable[[Any, GradBucket], torch.futures.Future]

# A parameter whose gradient is None is left alone by the local optimizer's step.
_NO_PARAM_UPDATE: None = None


def _reduced_gradients(bucket: GradBucket, fut: torch.futures.Future) -> list[torch.Tensor]:
    """The bucket's reduced gradients, one per parameter: views of the future's tensor, which
    DDP will copy into the bucket (PyTorch reads ``bucket.gradients()``, the same thing for
    hooks that reduce in place, such as ``allreduce_hook``)."""
    value = fut.value()
    result = value[0] if isinstance(value, (list, tuple)) else value
    buffer = bucket.buffer()
    if (not isinstance(result, torch.Tensor) or result.is_sparse or result.numel() != buffer.numel()
            or result.data_ptr() == buffer.data_ptr()):
        return bucket.gradients()
    flat, views, offset = result.reshape(-1), [], 0
    for p in bucket.parameters():
        views.append(flat[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()
    return views


def _perform_local_step(bucket: GradBucket, zero: ZeroRedundancyOptimizer, rank: int,
                        fut: torch.futures.Future) -> None:
    """Step this rank's parameters of ``bucket`` with its reduced gradients (``fut`` is done)."""
    info = zero._overlap_info
    index = bucket.index()
    if len(zero.optim.param_groups) != 1:
        raise AssertionError("Overlapping DDP with ZeRO only supports a single parameter group")
    if index not in info.offsets:
        raise AssertionError(f"Bucket index {index} was not assigned to rank {rank}")
    gradients: list[torch.Tensor | None] = [_NO_PARAM_UPDATE] * len(zero.optim.param_groups[0]["params"])
    assignment = zero._bucket_assignments_per_rank[rank][index]
    start = info.offsets[index]
    mine = _reduced_gradients(bucket, fut)[assignment.offset:assignment.offset + len(assignment.parameters)]
    gradients[start:start + len(mine)] = mine
    zero._local_step(gradients)


def _broadcast_bucket(bucket_index: int, zero: ZeroRedundancyOptimizer) -> None:
    """Issue the broadcasts of bucket ``bucket_index``'s updated pieces, owners in rank order."""
    info = zero._overlap_info
    if len(info.assigned_ranks_per_bucket) <= bucket_index:
        raise AssertionError("`assigned_ranks_per_bucket` is not fully constructed")
    owners = sorted(info.assigned_ranks_per_bucket[bucket_index])  # the same order on every rank
    if not owners:
        raise AssertionError(f"Bucket {bucket_index} should be assigned to at least one rank")
    for owner in owners:
        tensor = zero._bucket_assignments_per_rank[owner][bucket_index].tensor
        info.broadcast_handles.append(broadcast(tensor, group_src=owner, group=zero.process_group, async_op=True))


def _save_ddp_bucket_info(bucket: GradBucket, zero: ZeroRedundancyOptimizer) -> None:
    """Record a (rebuilt) bucket's parameters for the partition, and its size for sharding."""
    info = zero._overlap_info
    params = bucket.parameters()
    if not params:
        raise AssertionError("Empty bucket")
    info.params_per_bucket.append(params)
    if info.shard_buckets:
        info.total_size += sum(p.numel() for p in params)


def _buckets_are_final(ddp: DistributedDataParallel) -> bool:
    """Whether DDP's buckets are the ones it keeps, when PyTorch's would be.

    PyTorch rebuilds before the second forward, or under ``static_graph`` before the
    third (its first static iteration records no arrival order); torchdist rebuilds
    before the second in both cases, so under ``static_graph`` one more backward is
    waited for, to update nothing in the same iterations as PyTorch."""
    if not ddp._has_rebuilt_buckets:
        return False
    return not ddp.static_graph or ddp.reducer.num_backward >= 2


def _hook_with_zero_step_setup(ddp_ref: weakref.ref, zero: ZeroRedundancyOptimizer, bucket: GradBucket) -> None:
    """Before the optimizer can step: wait for the rebuild, record the buckets for one
    iteration, then initialize ZeRO at the next iteration's first bucket."""
    info = zero._overlap_info
    if not _buckets_are_final(ddp_ref()):
        if info.status != _OverlapStatus.UNINITIALIZED:
            raise AssertionError(f"ZeRO overlap status {info.status.name} before DDP rebuilt its buckets")
        return
    if info.status == _OverlapStatus.UNINITIALIZED:
        info.status = _OverlapStatus.DDP_HAS_REBUILT_BUCKETS
    if info.status == _OverlapStatus.DDP_HAS_REBUILT_BUCKETS:
        if bucket.index() == 0 and info.params_per_bucket:
            zero._init_zero_for_overlap()  # every bucket was recorded in the previous iteration
        else:
            _save_ddp_bucket_info(bucket, zero)


def _checked(ddp: DistributedDataParallel, zero: ZeroRedundancyOptimizer, shard_buckets: bool) -> weakref.ref:
    """PyTorch's checks and settings, common to both hooks; a weak reference to ``ddp``."""
    if not zero._overlap_with_ddp:
        raise ValueError("ZeroRedundancyOptimizer must be constructed with `overlap_with_ddp=True` to use this hook "
                         "properly")
    if ddp.find_unused_parameters and not ddp.static_graph:
        warnings.warn("DistributedDataParallel with find_unused_parameters=True never rebuilds its buckets, so the "
                      "ZeroRedundancyOptimizer overlapped with it is never initialized and never updates the "
                      "parameters (as in PyTorch). Use static_graph=True or find_unused_parameters=False.",
                      UserWarning, stacklevel=3)
    if shard_buckets:
        zero._overlap_info.shard_buckets = True
        zero._overlap_info.total_size = 0
    return weakref.ref(ddp)


def _finish_iteration(zero: ZeroRedundancyOptimizer) -> None:
    """Every parameter is updated before the next forward."""
    zero._overlap_info.wait_for_broadcasts()
    zero._overlap_info.clear_per_iter_info()


def _step_bucket(zero: ZeroRedundancyOptimizer, index: int) -> None:
    """Wait for bucket ``index``'s all-reduce if this rank owns part of it, step that part,
    then issue the bucket's broadcasts (every rank)."""
    info = zero._overlap_info
    if zero.rank in info.assigned_ranks_per_bucket[index]:
        if index not in info.bucket_index_to_future:
            raise AssertionError(f"All-reduce future for bucket {index} not saved on rank {zero.rank}")
        fut = info.bucket_index_to_future[index]
        fut.wait()
        _perform_local_step(info.bucket_index_to_bucket[index], zero, zero.rank, fut)
    _broadcast_bucket(index, zero)


def _record_bucket(zero: ZeroRedundancyOptimizer, bucket: GradBucket, fut: torch.futures.Future) -> int:
    """Keep the bucket and its future for the step; check that buckets come 0, 1, 2, ..."""
    info = zero._overlap_info
    index = bucket.index()
    if len(info.assigned_ranks_per_bucket) <= index:
        raise AssertionError("`assigned_ranks_per_bucket` is not fully constructed")
    seen = info.bucket_indices_seen
    if seen and seen[-1] != index - 1:
        raise AssertionError("Bucket indices are not in incremental order")
    if not seen and index != 0:
        raise AssertionError("Bucket indices do not start from 0")
    seen.append(index)
    info.bucket_index_to_bucket[index] = bucket
    info.bucket_index_to_future[index] = fut
    return index


def hook_with_zero_step(hook: _Hook, ddp: DistributedDataParallel, zero: ZeroRedundancyOptimizer,
                        shard_buckets: bool = False) -> Callable[[Any, GradBucket], torch.futures.Future]:
    """``hook`` followed, at the last bucket, by ZeRO's step of every bucket in order.

    Backward computes without interruption; the optimizer computation and the
    broadcasts follow it, overlapping the all-reduces still in flight (preferable when
    communication is slow relative to computation). ``shard_buckets``: split each
    bucket over possibly several ranks for an even load, instead of whole buckets
    round robin. Raises ``ValueError`` if ``zero`` was not built with
    ``overlap_with_ddp=True``. The first two iterations (three with ``static_graph``)
    update nothing (see the module docstring)."""
    ddp_ref = _checked(ddp, zero, shard_buckets)

    def hook_with_zero_fn(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut = hook(state, bucket)
        _hook_with_zero_step_setup(ddp_ref, zero, bucket)
        if zero._overlap_info.status != _OverlapStatus.INITIALIZED:
            return fut
        index = _record_bucket(zero, bucket, fut)
        num_buckets = len(zero._overlap_info.params_per_bucket)
        if index != num_buckets - 1:
            return fut
        # Not chained on the last all-reduce's future: the earlier buckets need not wait for it.
        for earlier in range(num_buckets):
            _step_bucket(zero, earlier)
        _finish_iteration(zero)
        return fut

    return hook_with_zero_fn


def hook_with_zero_step_interleaved(hook: _Hook, ddp: DistributedDataParallel, zero: ZeroRedundancyOptimizer,
                                    shard_buckets: bool = False) -> Callable[[Any, GradBucket], torch.futures.Future]:
    """``hook`` with ZeRO's step of each bucket as soon as the next bucket has been issued.

    The optimizer computation and broadcasts are interleaved with backward and its
    all-reduces (preferable when communication is fast relative to computation):
    the hook of bucket ``i`` issues its all-reduce, then waits for bucket ``i - 1``'s,
    steps it and issues its broadcasts; the last bucket's hook also does its own.
    Arguments, errors and warm-up iterations are :func:`hook_with_zero_step`'s."""
    ddp_ref = _checked(ddp, zero, shard_buckets)

    def hook_with_zero_interleaved_fn(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut = hook(state, bucket)
        _hook_with_zero_step_setup(ddp_ref, zero, bucket)
        if zero._overlap_info.status != _OverlapStatus.INITIALIZED:
            return fut
        index = _record_bucket(zero, bucket, fut)
        if index > 0:
            _step_bucket(zero, index - 1)
        if index == len(zero._overlap_info.params_per_bucket) - 1:
            _step_bucket(zero, index)
            _finish_iteration(zero)
        return fut

    return hook_with_zero_interleaved_fn
