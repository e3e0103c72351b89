"""PyTorch's ``torch.distributed.tensor._utils`` helpers that checkpointing and FSDP code import by that path."""

from __future__ import annotations

from typing import Sequence

import torch

from ..device_mesh import DeviceMesh
from ._placements import Placement
from ._spec import compute_local_shape_and_global_offset, global_shape_from_local

__all__ = ["compute_local_shape_and_global_offset", "compute_global_tensor_info"]


def compute_global_tensor_info(tensor: torch.Tensor, mesh: DeviceMesh,
                               placements: Sequence[Placement]) -> tuple[list[int], list[int]]:
    """Global shape and stride of a tensor whose every shard has ``tensor``'s shape (``from_local``'s rule)."""
    shape, stride = global_shape_from_local(tensor, mesh, placements)
    return list(shape), list(stride)
