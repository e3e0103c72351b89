"""``loss_parallel()``: cross-entropy on logits sharded on the class dimension, without gathering them.

Inside the context a dispatch mode answers four aten ops when their input is a
DTensor whose class dimension is sharded on exactly one mesh dimension (the
"TP" dimension); every other op goes on to DTensor's own dispatch:

=============================  =================================================================
``_log_softmax``               local max, all-reduce(max); local sum of exp, all-reduce(sum):
                               log-probabilities keep the input's shards
``nll_loss(2d)_forward``       each rank picks the targets that fall in its class block (others
                               masked to 0); all-reduce(sum) of the picked values
``nll_loss(2d)_backward``      -1 (times weight and grad) at the targets in this rank's block
``_log_softmax_backward_data`` grad - exp(out) * all-reduce(sum over classes of grad)
=============================  =================================================================

So a forward costs two all-reduces of one value per sample and a third for the
picked log-probabilities; the backward one. PyTorch fuses the two backward ops
instead (its log-softmax backward passes the gradient through and the nll
backward adds ``exp(out)``), which saves that all-reduce but is only right when
the log-softmax feeds nll_loss; this version is right for any use of
log_softmax inside the context. Targets take the input's placements with the
class dimension removed (TP dimension Replicate); ``weight`` is replicated.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..._c10d.collectives import all_reduce
from ..._process_group.reduce_op import ReduceOp
from .._api import DTensor
from .._placements import Partial, Placement, Replicate, Shard, shard_size_and_offset
from .._spec import DTensorSpec, TensorMeta, contiguous_strides

aten = torch.ops.aten

__all__ = ["loss_parallel"]

_NONE, _MEAN, _SUM = 0, 1, 2  # aten's reduction codes


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Within this context, ``F.cross_entropy``/``nn.CrossEntropyLoss`` (and ``log_softmax``, ``nll_loss``) accept
    class-sharded DTensor logits; the ``backward()`` must run inside the context too.

    ``target`` holds class indices (a plain tensor only where its placements would all be Replicate);
    ``label_smoothing`` and class probabilities as targets are not supported. ``reduction="mean"`` needs a 1-D mesh.
    """
    with _LossParallelMode():
        yield


def _tp_mesh_dim(placements: tuple[Placement, ...], dim: int) -> int:
    """The one mesh dimension that shards tensor dimension ``dim``; the others must be Shard or Replicate."""
    sharding = [i for i, p in enumerate(placements) if p.is_shard(dim)]
    if len(sharding) != 1:
        raise ValueError(f"loss_parallel() requires exactly one mesh dim to shard tensor dimension {dim}, but got "
                         f"placements {placements} with {len(sharding)} such mesh dim(s). Shard the logits on their "
                         "class dimension (e.g. ColwiseParallel(use_local_output=False) on the output layer).")
    for i, p in enumerate(placements):
        if i != sharding[0] and not (p.is_shard() or p.is_replicate()):
            raise ValueError(f"loss_parallel() expects non-TP mesh dims to be Shard or Replicate, got {p} at dim {i}.")
    return sharding[0]


def _target_placements(placements: tuple[Placement, ...], class_dim: int) -> tuple[Placement, ...]:
    """The input's placements with the class dimension removed: its shard becomes Replicate, later dims shift."""
    out: list[Placement] = []
    for p in placements:
        if isinstance(p, Shard):
            out.append(Replicate() if p.dim == class_dim else Shard(p.dim - 1) if p.dim > class_dim else p)
        else:
            out.append(p)
    return tuple(out)


def _local_of(value: Any, placements: tuple[Placement, ...], what: str) -> torch.Tensor | None:
    """The block of ``target``/``weight`` this rank uses: a DTensor must have ``placements``; a plain tensor is
    taken as is where every placement is Replicate."""
    if value is None:
        return None
    if isinstance(value, DTensor):
        if value.placements != placements:
            raise RuntimeError(f"Expected {placements} but got {value.placements}.")
        return value._local_tensor
    if any(p.is_shard() for p in placements):
        raise ValueError(f"loss_parallel() requires a DTensor (not a plain torch.Tensor) {what} when the derived "
                         f"placements {placements} contain Shard; wrap it with DTensor.from_local or "
                         "distribute_tensor to make the sharding explicit.")
    return value


def _wrap(local: torch.Tensor, like: DTensorSpec, placements: tuple[Placement, ...], shape: torch.Size) -> DTensor:
    spec = DTensorSpec(like.mesh, placements, TensorMeta(shape, contiguous_strides(shape), local.dtype))
    return DTensor(local, spec, requires_grad=False)


class _ClassBlock:
    """Which classes this rank holds on the TP mesh dimension, and where each target falls."""

    def __init__(self, x: DTensor, class_dim: int, target: torch.Tensor, ignore_index: int) -> None:
        self.mesh_dim = _tp_mesh_dim(x.placements, class_dim)
        mesh = x.device_mesh
        self.group = mesh.get_group(self.mesh_dim)
        coordinate = mesh.get_coordinate()
        assert coordinate is not None  # ranks outside the mesh hold no DTensor blocks
        length, offset = shard_size_and_offset(x.shape[class_dim], mesh.size(self.mesh_dim), coordinate[self.mesh_dim])
        self.valid = target != ignore_index
        self.mine = self.valid & (target >= offset) & (target < offset + length)
        self.local_index = torch.where(self.mine, target - offset, torch.zeros_like(target))
        self.safe_target = torch.where(self.valid, target, torch.zeros_like(target))


def _log_softmax(x: DTensor, dim: int, half_to_float: bool) -> DTensor:
    dim = dim % max(x.ndim, 1)
    mesh_dim = _tp_mesh_dim(x.placements, dim)
    group = x.device_mesh.get_group(mesh_dim)
    local = x._local_tensor
    compute = torch.float32 if local.dtype in (torch.float16, torch.bfloat16) else local.dtype
    local = local.to(compute).contiguous()
    if local.numel() == 0:
        shifted = local
    else:
        # An empty class block contributes -inf to the max and 0 to the sum.
        top = torch.amax(local, dim, keepdim=True) if local.size(dim) else \
            local.new_full(local.sum(dim, keepdim=True).shape, float("-inf"))
        all_reduce(top, op=ReduceOp.MAX, group=group)
        shifted = local - top
    sumexp = torch.sum(torch.exp(shifted), dim, keepdim=True)
    all_reduce(sumexp, op=ReduceOp.SUM, group=group)
    out = shifted - torch.log(sumexp)
    out = out.to(torch.float32 if half_to_float else x.dtype)
    return _wrap(out, x._spec, x.placements, x.shape)


def _log_softmax_backward(grad: DTensor, out: DTensor, dim: int, input_dtype: torch.dtype) -> DTensor:
    dim = dim % max(out.ndim, 1)
    mesh_dim = _tp_mesh_dim(out.placements, dim)
    if isinstance(grad, DTensor) and grad.placements != out.placements:
        grad = grad.redistribute(placements=out.placements)
    g = grad._local_tensor if isinstance(grad, DTensor) else grad
    total = g.sum(dim, keepdim=True)
    all_reduce(total, op=ReduceOp.SUM, group=out.device_mesh.get_group(mesh_dim))
    result = (g - torch.exp(out._local_tensor) * total).to(input_dtype)
    return _wrap(result, out._spec, out.placements, out.shape)


def _class_dim(x: DTensor) -> int:
    return 1 if x.ndim >= 2 else 0


def _nll_forward(x: DTensor, target: Any, weight: Any, reduction: int, ignore_index: int,
                 ) -> tuple[DTensor, torch.Tensor]:
    cdim = _class_dim(x)
    mesh_dim = _tp_mesh_dim(x.placements, cdim)
    target_pl = _target_placements(x.placements, cdim)
    local_target = _local_of(target, target_pl, "target")
    local_weight = _local_of(weight, tuple(Replicate() for _ in x.placements), "weight")
    block = _ClassBlock(x, cdim, local_target, ignore_index)
    local = x._local_tensor
    picked = torch.gather(local, cdim, block.local_index.unsqueeze(cdim)).squeeze(cdim)
    picked = torch.where(block.mine, picked, torch.zeros_like(picked))
    all_reduce(picked, op=ReduceOp.SUM, group=block.group)  # exactly one rank holds each sample's target
    w_target = local_weight[block.safe_target] if local_weight is not None else None
    if w_target is not None:
        picked = picked * w_target
    result = torch.where(block.valid, -picked, torch.zeros_like(picked))
    if reduction == _NONE and local.ndim > 1:
        target_shape = target.shape if isinstance(target, DTensor) else local_target.shape
        return _wrap(result, x._spec, target_pl, torch.Size(target_shape)), local.new_full((), 0.0)
    if w_target is not None:
        total_weight = torch.where(block.valid, w_target, torch.zeros_like(w_target)).sum()
    else:
        total_weight = block.valid.sum().to(local.dtype)
    if reduction == _MEAN and x.device_mesh.ndim > 1:
        raise NotImplementedError("loss_parallel() with reduction='mean' is only supported on one-dimensional "
                                  f"DeviceMesh; got mesh with ndim={x.device_mesh.ndim}. Use reduction='sum' or "
                                  "'none' instead.")
    if reduction == _SUM:
        result = result.sum()
    elif reduction == _MEAN:
        result = result.sum() / total_weight
    # The TP all-reduce makes the value whole there; other sharded mesh dims summed only their own samples.
    placements = tuple(Replicate() if i == mesh_dim else Partial() if p.is_shard() else p
                       for i, p in enumerate(x.placements))
    if reduction == _NONE:  # a 1-d input (one sample): a scalar loss
        placements = tuple(Replicate() if i == mesh_dim else p for i, p in enumerate(x.placements))
    return _wrap(result, x._spec, placements, torch.Size(())), total_weight


def _nll_backward(grad: DTensor, x: DTensor, target: Any, weight: Any, reduction: int, ignore_index: int,
                  total_weight: torch.Tensor) -> DTensor:
    cdim = _class_dim(x)
    target_pl = _target_placements(x.placements, cdim)
    local_target = _local_of(target, target_pl, "target")
    local_weight = _local_of(weight, tuple(Replicate() for _ in x.placements), "weight")
    block = _ClassBlock(x, cdim, local_target, ignore_index)
    if isinstance(grad, DTensor):
        if reduction == _NONE and grad.ndim > 0 and grad.placements != target_pl:
            grad = grad.redistribute(placements=target_pl)
        g = grad._local_tensor
    else:  # a plain gradient (backward(gradient=tensor)): taken as this rank's block
        g = grad
    if isinstance(total_weight, DTensor):
        total_weight = total_weight._local_tensor
    if reduction == _MEAN:
        g = g / total_weight
    g = g.expand(local_target.shape) if g.ndim == 0 else g
    if local_weight is not None:
        g = g * local_weight[block.safe_target]
    g = torch.where(block.mine, g, torch.zeros_like(g))
    result = torch.zeros_like(x._local_tensor)
    result.scatter_(cdim, block.local_index.unsqueeze(cdim), (-g).unsqueeze(cdim).to(result.dtype))
    return _wrap(result, x._spec, x.placements, x.shape)


class _LossParallelMode(TorchDispatchMode):
    """Answers the loss ops on class-sharded DTensors; hands every other call on unchanged."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is None or not _has_dtensor(args):
            return func(*args, **kwargs)
        return handler(*args, **kwargs)


def _has_dtensor(args: tuple) -> bool:
    return any(isinstance(a, DTensor) for a in args)


_HANDLERS = {
    aten._log_softmax.default: _log_softmax,
    aten._log_softmax_backward_data.default: _log_softmax_backward,
    aten.nll_loss_forward.default: _nll_forward,
    aten.nll_loss2d_forward.default: _nll_forward,
    aten.nll_loss_backward.default: _nll_backward,
    aten.nll_loss2d_backward.default: _nll_backward,
}
