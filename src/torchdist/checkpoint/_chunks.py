"""The one question the planners ask of a value: which chunks of which global tensor does this rank hold?

A plain tensor is the whole of itself (one chunk at offset 0, the same on every
rank that holds it, so replicas deduplicate by key and offset). A DTensor is
its local tensor at the offsets its placements give this rank's mesh
coordinate. ``LocalShards`` says it explicitly, for sharding schemes that have
no class of their own. Saving writes each held chunk; loading copies into each
held chunk the overlapping boxes of the saved chunks, so any sharding loads
into any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..tensor import DTensor
from ..tensor._spec import compute_local_shape_and_global_offset
from .metadata import TensorProperties


@dataclass(frozen=True)
class LocalChunk:
    """A box of a global tensor held here: its global offsets and its data (a view where possible)."""

    offsets: torch.Size
    tensor: torch.Tensor


@dataclass(frozen=True)
class TensorView:
    """What a rank holds of one global tensor."""

    size: torch.Size
    properties: TensorProperties
    chunks: list[LocalChunk]
    sharded: bool  # True for DTensor / LocalShards (written as SHARD items), False for a plain tensor


class LocalShards:
    """This rank's chunks (global offsets, local tensor) of a global tensor of shape ``size``."""

    def __init__(self, size: Sequence[int], chunks: Sequence[tuple[Sequence[int], torch.Tensor]]):
        self.size = torch.Size(size)
        self.chunks = [LocalChunk(torch.Size(offsets), tensor) for offsets, tensor in chunks]
        for chunk in self.chunks:
            if len(chunk.offsets) != len(self.size) or chunk.tensor.dim() != len(self.size) or any(
                    o < 0 or o + n > s for o, n, s in zip(chunk.offsets, chunk.tensor.shape, self.size)):
                raise ValueError(f"LocalShards: a chunk of shape {tuple(chunk.tensor.shape)} at offsets "
                                 f"{tuple(chunk.offsets)} does not fit in a tensor of shape {tuple(self.size)}")

    def __repr__(self) -> str:
        return f"LocalShards(size={tuple(self.size)}, offsets={[tuple(c.offsets) for c in self.chunks]})"


def is_tensor_like(value: object) -> bool:
    return isinstance(value, (torch.Tensor, LocalShards))


def _dtensor_offsets(value: DTensor) -> torch.Size | None:
    """Global offsets of this rank's local tensor, None off the mesh."""
    for mesh_dim, placement in enumerate(value.placements):
        if placement.is_partial():
            raise ValueError(f"checkpoint: a DTensor with a Partial placement on mesh dim {mesh_dim} holds "
                             "unreduced values; redistribute it to Shard or Replicate before saving or loading")
    if value.device_mesh.get_coordinate() is None:
        return None
    _, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return torch.Size(offsets)


def tensor_view(value: object) -> TensorView | None:
    """The chunks of ``value`` this rank holds, or None when ``value`` is not a tensor."""
    if isinstance(value, DTensor):
        local = value.to_local()
        offsets = _dtensor_offsets(value)
        properties = TensorProperties.create_from_tensor(local)
        properties.requires_grad = value.requires_grad
        chunks = [] if offsets is None else [LocalChunk(offsets, local)]
        return TensorView(torch.Size(value.shape), properties, chunks, sharded=True)
    if isinstance(value, LocalShards):
        dtype_of = value.chunks[0].tensor if value.chunks else torch.empty(0)
        return TensorView(value.size, TensorProperties.create_from_tensor(dtype_of), list(value.chunks), sharded=True)
    if isinstance(value, torch.Tensor):
        return TensorView(value.shape, TensorProperties.create_from_tensor(value),
                          [LocalChunk(torch.Size([0] * value.dim()), value)], sharded=False)
    return None


def overlap(saved_offsets: Sequence[int], saved_sizes: Sequence[int], local_offsets: Sequence[int],
            local_sizes: Sequence[int]) -> tuple[torch.Size, torch.Size, torch.Size] | None:
    """The common box of a saved chunk and a local chunk: (offsets in saved, offsets in local, lengths), or None."""
    starts = [max(a, b) for a, b in zip(saved_offsets, local_offsets)]
    ends = [min(a + n, b + m) for a, n, b, m in zip(saved_offsets, saved_sizes, local_offsets, local_sizes)]
    if any(end <= start for start, end in zip(starts, ends)):
        return None
    return (torch.Size(s - o for s, o in zip(starts, saved_offsets)),
            torch.Size(s - o for s, o in zip(starts, local_offsets)),
            torch.Size(e - s for s, e in zip(starts, ends)))


def narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """The box ``offsets``+``lengths`` of ``tensor``, as a view."""
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        if start != 0 or length != tensor.shape[dim]:
            tensor = tensor.narrow(dim, start, length)
    return tensor
