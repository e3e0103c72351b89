"""The few DTensor operations FSDP needs, in one place: build a sharded parameter or gradient, read a local shard.

FSDP keeps each sharded parameter as ``nn.Parameter(DTensor)`` with placements
``(Shard(d),)`` (or ``(Replicate(), Shard(d))`` for HSDP) and the parameter's
global shape and stride, as PyTorch does; everything else in this package works
on plain local tensors.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..tensor import DTensor, Replicate, Shard

__all__ = ["DTensor", "Replicate", "Shard", "sharded_parameter", "sharded_tensor", "local_of"]


def sharded_tensor(local: torch.Tensor, mesh, placements: tuple, shape: torch.Size,
                   stride: tuple[int, ...]) -> torch.Tensor:
    """A DTensor over ``local`` (this rank's shard, not copied) with the given global shape and stride."""
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def sharded_parameter(local: torch.Tensor, mesh, placements: tuple, shape: torch.Size, stride: tuple[int, ...],
                      requires_grad: bool) -> nn.Parameter:
    """``nn.Parameter`` holding a DTensor over ``local``; the parameter keeps the DTensor type."""
    return nn.Parameter(sharded_tensor(local.detach(), mesh, placements, shape, stride), requires_grad=requires_grad)


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (detached), or the tensor itself if it is not one."""
    with torch.no_grad():
        return tensor.to_local().detach() if isinstance(tensor, DTensor) else tensor.detach()
