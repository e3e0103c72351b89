"""The objects that configure ``fully_shard``: mixed precision, offloading, data-parallel mesh dims, and the
communication primitives a user may swap in (``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``).

The policies are plain dataclasses with PyTorch's fields and defaults, so that a
script's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``
means the same thing here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._c10d.collectives import all_gather_single, reduce_scatter_single
from .._process_group.process_group import ProcessGroup
from .._process_group.reduce_op import ReduceOp
from .._process_group.work import Work

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "DataParallelMeshDims", "Comm",
           "AllGather", "ReduceScatter", "DefaultAllGather", "DefaultReduceScatter"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of one ``fully_shard`` group.

    ``param_dtype``: the dtype parameters are all-gathered in and forward/backward
    compute in (the sharded parameters keep their own dtype). ``reduce_dtype``: the
    dtype gradients are reduced in (default: the gradients' own dtype).
    ``output_dtype``: floating-point forward outputs are cast to it.
    ``cast_forward_inputs``: cast floating-point forward inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer states stay on the mesh's device."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients on the CPU (on a CPU mesh they are there already).

    ``pin_memory`` asks for page-locked host memory; it only matters with an accelerator.
    """

    pin_memory: bool = True


@dataclass
class DataParallelMeshDims:
    """Names the data-parallel dimensions of a full SPMD mesh (``shard`` and/or ``replicate``, each a name or a
    tuple of names to flatten)."""

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("At least one of shard or replicate must be set in DataParallelMeshDims")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


class Comm(ABC):
    """A communication primitive of FSDP: where its output buffer comes from, and what it calls."""

    @abstractmethod
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer for the collective's output (fresh, or one the primitive reuses)."""


class AllGather(Comm):
    """Gathers every rank's flat parameter shard into ``output_tensor`` (the all-gather of a group)."""

    @abstractmethod
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: ProcessGroup,
                 async_op: bool = False) -> Work | None: ...


class ReduceScatter(Comm):
    """Reduces the flat gradients over ``group`` and leaves this rank's shard in ``output_tensor``."""

    @abstractmethod
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: ProcessGroup,
                 op: ReduceOp, async_op: bool = False) -> Work | None: ...


class DefaultAllGather(AllGather):
    """A fresh buffer, and ``all_gather_into_tensor``."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: ProcessGroup,
                 async_op: bool = False) -> Work | None:
        return all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class DefaultReduceScatter(ReduceScatter):
    """A fresh buffer, and ``reduce_scatter_tensor``."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: ProcessGroup,
                 op: ReduceOp, async_op: bool = False) -> Work | None:
        return reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
