"""Ops that the dispatcher answers itself instead of running them on the blocks through a rule.

``is_same_size`` (global shapes), ``equal`` (blocks compared, answers combined over the mesh), ``item``
(replicated first), and vector norms of whole tensors: each rank takes the norm of its block and the blocks'
norms are combined over the sharded mesh dimensions (sum of p-th powers, or max/min for the infinity norms),
which is how ``clip_grad_norm_`` gets one total norm without gathering the gradients.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .._c10d.collectives import all_reduce
from .._process_group.reduce_op import ReduceOp
from ._api import DTensor
from ._placements import Partial, Replicate, Shard
from ._redistribute import redistribute_local_tensor
from ._spec import DTensorSpec, TensorMeta

aten = torch.ops.aten

__all__ = ["SPECIAL"]


def _is_same_size(func, args, kwargs) -> bool:
    return tuple(args[0].shape) == tuple(args[1].shape)


def _equal(func, args, kwargs) -> bool:
    """Both tensors brought to the first one's shards, compared per block, the answers combined over the mesh."""
    a, b = args[0], args[1]
    if not (isinstance(a, DTensor) and isinstance(b, DTensor)):
        from ._dispatch import collect

        collect(func, [a, b])  # raises PyTorch's error for a DTensor compared with a plain tensor
    if a.shape != b.shape:
        return False
    target = tuple(Replicate() if p.is_partial() else p for p in a.placements)
    la = redistribute_local_tensor(a._local_tensor, a._spec, target)
    lb = redistribute_local_tensor(b._local_tensor, b._spec, target)
    same = torch.tensor([int(torch.equal(la, lb))], dtype=torch.int32)
    mesh = a.device_mesh
    for mesh_dim in range(mesh.ndim):
        if mesh.size(mesh_dim) > 1:
            all_reduce(same, op=ReduceOp.MIN, group=mesh.get_group(mesh_dim))
    return bool(same.item())


def _local_scalar_dense(func, args, kwargs) -> Any:
    x = args[0]
    local = redistribute_local_tensor(x._local_tensor, x._spec, tuple(Replicate() for _ in x.placements))
    return local.item()


def _norm_of(x: DTensor, ord: float, dtype: torch.dtype | None) -> DTensor:
    """The ``ord``-norm of the whole of ``x`` as a Replicate scalar DTensor."""
    local = x._local_tensor
    placements = tuple(Replicate() if isinstance(p, Partial) else p for p in x.placements)
    if placements != x.placements:
        local = redistribute_local_tensor(local, x._spec, placements)
    ord = float(ord)
    if local.numel():
        value = torch.linalg.vector_norm(local, ord, dtype=dtype)
    else:  # an empty block: the neutral element of the combination below
        value = torch.zeros((), dtype=dtype or local.dtype) + (math.inf if ord == -math.inf else 0.0)
    mesh = x.device_mesh
    sharded = [m for m, p in enumerate(placements) if isinstance(p, Shard) and mesh.size(m) > 1]
    if sharded:
        if ord in (math.inf, -math.inf):
            op = ReduceOp.MAX if ord == math.inf else ReduceOp.MIN
        else:
            op = ReduceOp.SUM
            value = value if ord == 0 else value ** ord
        value = value.clone()
        for mesh_dim in sharded:
            all_reduce(value, op=op, group=mesh.get_group(mesh_dim))
        if ord not in (0.0, math.inf, -math.inf):
            value = value ** (1.0 / ord)
    replicate = tuple(Replicate() for _ in placements)
    return DTensor(value, DTensorSpec(mesh, replicate, TensorMeta(torch.Size(()), (), value.dtype)),
                   requires_grad=False)


def _foreach_norm(func, args, kwargs) -> list:
    tensors = args[0]
    ord = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    if not all(isinstance(t, DTensor) for t in tensors):
        raise RuntimeError(f"{func} got mixed torch.Tensor and DTensor, need to convert all torch.Tensor to "
                           "DTensor before calling distributed operators!")
    return [_norm_of(t, ord, dtype) for t in tensors]


def _vector_norm(func, args, kwargs) -> Any:
    x = args[0]
    ord = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    if dim is not None or keepdim:
        from ._dispatch import run_with_rule_or_fallback

        return run_with_rule_or_fallback(func, args, kwargs)
    return _norm_of(x, ord, kwargs.get("dtype"))


SPECIAL = {
    aten.is_same_size.default: _is_same_size,
    aten.equal.default: _equal,
    aten._local_scalar_dense.default: _local_scalar_dense,
    aten._foreach_norm.Scalar: _foreach_norm,
    aten.linalg_vector_norm.default: _vector_norm,
}
