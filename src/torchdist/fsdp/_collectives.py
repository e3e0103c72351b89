"""The two collectives of a ``fully_shard`` group: one flat all-gather of parameters, one flat reduce-scatter of
gradients (plus, for HSDP, an all-reduce of the reduced shard over the replicate group).

Cost per group and step, with ``N`` the padded numel of the group and ``W`` the
shard group size: all-gather moves ``(W-1)/W * N*W`` elements into each rank,
reduce-scatter the same out of it; HSDP adds an all-reduce of ``N`` elements over
the replicate group. Each collective is one call on one flat buffer per dtype,
which is why a group is the unit of communication.

Gradient averaging (``_divide_factors``) follows PyTorch's FSDP2: for float32
and bfloat16 the collective itself averages (``ReduceOp.AVG``); for other
dtypes (float16) the gradients are divided by about ``sqrt(n)`` before and the
rest after a SUM, so that neither the sum overflows nor small values flush to
zero; a custom ``gradient_divide_factor`` becomes a ``PREMUL_SUM``.
"""

from __future__ import annotations

from typing import Callable

import torch

from .._c10d.collectives import all_reduce
from .._process_group.reduce_op import ReduceOp
from .._process_group.work import Work
from ._api import AllGather, ReduceScatter
from ._mesh_info import MeshInfo
from ._param import FSDPParam, ShardLayout

__all__ = ["GroupAllGather", "reduce_gradients"]


class GroupAllGather:
    """All-gathers of one group's parameters in flight: one per all-gather dtype, in parameter order, by ``comm``.

    ``post_forward``: gather from the post-forward shards (``reshard_after_forward=k``) over
    ``mesh_info``'s groups of ``k`` ranks instead of from the sharded parameters.
    """

    def __init__(self, params: list[FSDPParam], mesh_info: MeshInfo, async_op: bool, comm: AllGather,
                 post_forward: bool = False) -> None:
        self._post_forward = post_forward
        self._buckets: list[tuple[list[FSDPParam], torch.Tensor, Work | None]] = []
        for bucket in _by_dtype(params, lambda p: p.all_gather_dtype):
            with torch.no_grad():
                flat = torch.cat([p.all_gather_input(self._layout(p)) for p in bucket])
            if mesh_info.shard_group is None:  # replicate-only (DDP): this rank's shard is the whole parameter
                self._buckets.append((bucket, flat, None))
                continue
            out = comm.allocate((flat.numel() * mesh_info.shard_size,), dtype=flat.dtype, device=flat.device)
            work = comm(output_tensor=out, input_tensor=flat, group=mesh_info.shard_group, async_op=async_op)
            self._buckets.append((bucket, out, work))

    def _layout(self, param: FSDPParam) -> ShardLayout:
        return param.post_forward_layout if self._post_forward else param.layout

    def wait_and_copy_out(self) -> None:
        """Wait for the all-gathers and fill every unsharded parameter from the gathered buffers."""
        for bucket, out, work in self._buckets:
            if work is not None:
                work.wait()
            offset = 0
            for param in bucket:
                layout = self._layout(param)
                columns = out.view(layout.world, -1)[:, offset:offset + layout.padded_numel]
                param.copy_out(columns, layout)
                offset += layout.padded_numel
        self._buckets = []


def reduce_gradients(params: list[FSDPParam], grads: list[torch.Tensor], mesh_info: MeshInfo,
                     divide_factor: float | None, force_sum: bool, all_reduce_grads: bool,
                     partial: torch.Tensor | None, hook: Callable[[torch.Tensor], None] | None,
                     comm: ReduceScatter) -> torch.Tensor | None:
    """Reduce-scatter (and for HSDP all-reduce) ``grads`` into the sharded ``.grad`` of ``params``.

    Returns the HSDP partial result to keep when ``all_reduce_grads`` is False
    (the all-reduce is deferred to a later backward, as PyTorch's
    ``set_requires_all_reduce(False)``), else None.
    """
    dtypes = {p.reduce_dtype or g.dtype for p, g in zip(params, grads)}
    if len(dtypes) != 1:
        raise AssertionError(f"FSDP reduce-scatter expects a uniform reduce dtype, got {dtypes}")
    dtype = dtypes.pop()
    world = mesh_info.shard_size
    replicate_group = mesh_info.replicate_group
    pre, post, rs_op, ar_op = _divide_factors(world, mesh_info.replicate_size if replicate_group else 1, dtype,
                                              divide_factor, force_sum)
    with torch.no_grad():
        flat = torch.cat([p.layout.scatter_block(g.to(dtype)) for p, g in zip(params, grads)], dim=1).reshape(-1)
        if pre is not None:
            flat.div_(pre)
        if world > 1:
            out = comm.allocate((flat.numel() // world,), dtype=flat.dtype, device=flat.device)
            work = comm(output_tensor=out, input_tensor=flat, group=mesh_info.shard_group, op=rs_op)
            if work is not None:
                work.wait()
        else:  # nothing to scatter: a custom factor still divides (and with a SUM, ``post`` divides again, as
            # PyTorch 2.13 does: kept so that training matches PyTorch's; docs/design/fsdp.md)
            out = flat / divide_factor if divide_factor is not None else flat
        if replicate_group is not None:
            if partial is not None:
                out += partial
            if not all_reduce_grads:
                return out
            all_reduce(out, op=ar_op, group=replicate_group)
        if hook is not None:
            hook(out)
        if post is not None:
            out.div_(post)
        offset = 0
        for param in params:
            param.accumulate_sharded_grad(out[offset:offset + param.layout.padded_numel])
            offset += param.layout.padded_numel
    for param in params:  # as after autograd accumulates a leaf's .grad
        for grad_hook in (getattr(param.sharded_param, "_post_accumulate_grad_hooks", None) or {}).values():
            grad_hook(param.sharded_param)
    return None


def _divide_factors(shard_size: int, replicate_size: int, dtype: torch.dtype, factor: float | None,
                    force_sum: bool) -> tuple[float | None, float | None, ReduceOp, ReduceOp]:
    """(pre-divide, post-divide, reduce-scatter op, all-reduce op) that average gradients over the data-parallel
    ranks, or divide them by ``factor``."""
    overflow_risk = dtype not in (torch.float32, torch.bfloat16)
    if not overflow_risk and not force_sum:
        if factor is None:
            op = ReduceOp.SUM if shard_size * replicate_size == 1 else ReduceOp.AVG
            return None, None, op, op
        rs_op = ReduceOp.AVG if factor == shard_size else ReduceOp.PREMUL_SUM(1 / factor)
        return None, None, rs_op, ReduceOp.SUM
    factor = float(shard_size * replicate_size) if factor is None else factor
    if not overflow_risk:  # summing only: divide once, after, on the smaller buffer
        return None, factor, ReduceOp.SUM, ReduceOp.SUM
    pre = 1
    while factor % pre == 0 and factor / pre > pre:  # a power of two near sqrt(factor)
        pre *= 2
    return pre, factor / pre, ReduceOp.SUM, ReduceOp.SUM


def _by_dtype(params: list[FSDPParam], key: Callable[[FSDPParam], torch.dtype]) -> list[list[FSDPParam]]:
    buckets: dict[torch.dtype, list[FSDPParam]] = {}
    for param in params:
        buckets.setdefault(key(param), []).append(param)
    return list(buckets.values())
