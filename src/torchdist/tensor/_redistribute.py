"""Changing a DTensor's placements: each changed mesh dimension becomes one collective on that dimension's group.

=====================  ==================================================
from -> to             what runs on the mesh dimension's process group
=====================  ==================================================
Shard(d) -> Replicate  all_gather_single (shards padded to equal length)
Partial -> Replicate   all_reduce with the partial's op
Partial -> Shard(d)    reduce_scatter_single (input padded)
Replicate -> Shard(d)  nothing: keep this rank's chunk
Replicate -> Partial   nothing: sum keeps 1/n of the value, avg/max/min all of it
Shard(d) -> Shard(e)   all_to_all_single (pieces flattened, so uneven works)
_StridedShard -> Repl. all_gather_single, then rows put back in order
Repl. -> _StridedShard nothing: keep this rank's strided rows
anything else          through Replicate
=====================  ==================================================

Shards of one tensor dimension on several mesh dimensions nest (the first
mesh dimension outermost), so a step may only touch a dimension that no later
mesh dimension still splits. The plan first tries to change each mesh dimension
directly, last to first, then first to last; if a step of either order would
break that rule it replicates every mesh dimension (last to first) and then
places each one (first to last), which is always correct.

Each collective is reported (``_c10d.comm_report.functional_collective``) under the functional-collective name
PyTorch's DTensor issues for it, which is what ``CommDebugMode`` counts.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .._c10d.collectives import all_gather_single, all_reduce, all_to_all_single, reduce_scatter_single
from .._c10d.comm_report import functional_collective
from .._process_group.reduce_op import ReduceOp
from ._placements import (Partial, Placement, Replicate, Shard, _StridedShard, is_shard_like, pad_dim, shard_indices,
                          shard_size_and_offset)
from ._spec import DTensorSpec

__all__ = ["redistribute_local_tensor", "reduce_op_of"]

#: What PyTorch's CommDebugMode counts for the collective of each step (its functional collectives).
_ALL_GATHER = "c10d_functional.all_gather_into_tensor"
_REDUCE_OPS = {"sum": ReduceOp.SUM, "avg": ReduceOp.AVG, "max": ReduceOp.MAX, "min": ReduceOp.MIN,
               "product": ReduceOp.PRODUCT}


def reduce_op_of(placement: Partial) -> ReduceOp:
    return _REDUCE_OPS[placement.reduce_op]


def _level_size(spec: DTensorSpec, placements: Sequence[Placement], mesh_dim: int, dim: int) -> int:
    """Rows of tensor dimension ``dim`` before mesh dimension ``mesh_dim`` splits it (outer shards applied)."""
    size = spec.shape[dim]
    coordinate = spec.mesh.get_coordinate()
    for outer in range(mesh_dim):
        placement = placements[outer]
        if is_shard_like(placement) and placement.dim == dim:
            size = len(shard_indices(placement, size, spec.mesh.size(outer), coordinate[outer]))
    return size


def _inner_shards(placements: Sequence[Placement], mesh_dim: int, dims: set[int]) -> bool:
    """Whether a mesh dimension after ``mesh_dim`` shards one of the tensor dimensions ``dims``."""
    return any(is_shard_like(p) and p.dim in dims for p in placements[mesh_dim + 1:])


def _gather(local: torch.Tensor, group, world: int, dim: int, size: int) -> torch.Tensor:
    """Shard(dim) -> Replicate on one mesh dimension of ``world`` ranks; ``size``: the dimension's gathered length."""
    full = -(-size // world)
    moved = pad_dim(local, dim, full).movedim(dim, 0).contiguous()
    out = moved.new_empty((world * full, *moved.shape[1:]))
    with functional_collective(_ALL_GATHER):
        all_gather_single(out, moved, group=group)
    pieces = [out.narrow(0, i * full, shard_size_and_offset(size, world, i)[0]) for i in range(world)]
    return torch.cat(pieces, 0).movedim(0, dim).contiguous()


def _gather_strided(local: torch.Tensor, group, placement: _StridedShard, world: int, size: int) -> torch.Tensor:
    """_StridedShard -> Replicate on one mesh dimension: all-gather the padded chunks, then put every row back at its
    place (chunk ``i`` holds rows ``placement.indices(size, world, i)``)."""
    dim = placement.dim
    rows = [placement.indices(size, world, i) for i in range(world)]
    full = max(len(r) for r in rows)
    moved = pad_dim(local, dim, full).movedim(dim, 0).contiguous()
    out = moved.new_empty((world * full, *moved.shape[1:]))
    with functional_collective(_ALL_GATHER):
        all_gather_single(out, moved, group=group)
    valid = torch.cat([out.narrow(0, i * full, len(r)) for i, r in enumerate(rows)], 0)
    order = torch.tensor([row for r in rows for row in r], dtype=torch.long, device=local.device)
    whole = valid.new_empty((size, *valid.shape[1:])).index_copy_(0, order, valid)
    return whole.movedim(0, dim).contiguous()


def _strided_step(local: torch.Tensor, spec: DTensorSpec, current: list[Placement], mesh_dim: int,
                  target: Placement) -> torch.Tensor:
    """A step from or to a _StridedShard (not to Partial): gather, select locally, or go through Replicate."""
    source = current[mesh_dim]
    world = spec.mesh.size(mesh_dim)
    rank = spec.mesh.get_coordinate()[mesh_dim]
    if isinstance(source, _StridedShard) and isinstance(target, Replicate):
        size = _level_size(spec, current, mesh_dim, source.dim)
        if world > 1:
            local = _gather_strided(local, spec.mesh.get_group(mesh_dim), source, world, size)
    elif isinstance(source, Replicate) and isinstance(target, _StridedShard):
        rows = torch.tensor(target.indices(local.size(target.dim), world, rank), dtype=torch.long,
                            device=local.device)
        local = local.index_select(target.dim, rows).contiguous()
    else:
        local = _step(local, spec, current, mesh_dim, Replicate())
        return _step(local, spec, current, mesh_dim, target)
    current[mesh_dim] = target
    return local


def _reduce_scatter(local: torch.Tensor, group, world: int, rank: int, dim: int, op: ReduceOp) -> torch.Tensor:
    """Partial -> Shard(dim) on one mesh dimension."""
    size = local.size(dim)
    full = -(-size // world)
    moved = pad_dim(local, dim, full * world).movedim(dim, 0).contiguous()
    out = moved.new_empty((full, *moved.shape[1:]))
    with functional_collective("c10d_functional.reduce_scatter_tensor"):
        reduce_scatter_single(out, moved, op=op, group=group)
    return out.narrow(0, 0, shard_size_and_offset(size, world, rank)[0]).movedim(0, dim).contiguous()


def _all_to_all(local: torch.Tensor, group, world: int, rank: int, src: int, dst: int, src_size: int) -> torch.Tensor:
    """Shard(src) -> Shard(dst) on one mesh dimension; ``src_size``: dimension ``src``'s length at this level."""
    dst_size = local.size(dst)
    sends = [local.narrow(dst, *reversed(shard_size_and_offset(dst_size, world, i))).contiguous().reshape(-1)
             for i in range(world)]
    my_dst_len = shard_size_and_offset(dst_size, world, rank)[0]
    shapes = []
    for peer in range(world):
        shape = list(local.shape)
        shape[src] = shard_size_and_offset(src_size, world, peer)[0]
        shape[dst] = my_dst_len
        shapes.append(shape)
    counts = [int(torch.Size(s).numel()) for s in shapes]
    out = local.new_empty(sum(counts))
    # PyTorch's shard_dim_alltoall: an all-gather on CPU meshes (gloo has no all-to-all), else its own op.
    with functional_collective(_ALL_GATHER if local.device.type == "cpu" else "_dtensor.shard_dim_alltoall"):
        all_to_all_single(out, torch.cat(sends) if sends else local.new_empty(0), output_split_sizes=counts,
                          input_split_sizes=[s.numel() for s in sends], group=group)
    received = [piece.reshape(shape) for piece, shape in zip(out.split(counts), shapes)]
    return torch.cat(received, src).contiguous()


def _partition(local: torch.Tensor, placement: Partial, world: int, rank: int) -> torch.Tensor:
    """Replicate -> Partial: values whose reduction over the mesh dimension is ``local``."""
    if placement.reduce_op == "sum":
        return local / world
    if placement.reduce_op == "product":
        raise NotImplementedError("redistribute: Replicate -> Partial(product) is not supported (as in PyTorch)")
    return local


def _step(local: torch.Tensor, spec: DTensorSpec, current: list[Placement], mesh_dim: int,
          target: Placement) -> torch.Tensor:
    """Change mesh dimension ``mesh_dim`` from ``current[mesh_dim]`` to ``target`` and record it in ``current``."""
    source = current[mesh_dim]
    if not isinstance(target, Partial) and (isinstance(source, _StridedShard) or isinstance(target, _StridedShard)):
        return _strided_step(local, spec, current, mesh_dim, target)
    mesh = spec.mesh
    world = mesh.size(mesh_dim)
    rank = mesh.get_coordinate()[mesh_dim]
    group = mesh.get_group(mesh_dim) if world > 1 else None
    if isinstance(target, Replicate):
        if isinstance(source, Shard):
            size = _level_size(spec, current, mesh_dim, source.dim)
            local = _gather(local, group, world, source.dim, size) if world > 1 else local
        elif isinstance(source, Partial) and world > 1:
            local = local.contiguous().clone() if not local.is_contiguous() else local.clone()
            with functional_collective("c10d_functional.all_reduce"):
                all_reduce(local, op=reduce_op_of(source), group=group)
    elif isinstance(target, Shard):
        if isinstance(source, Replicate):
            length, offset = shard_size_and_offset(local.size(target.dim), world, rank)
            local = local.narrow(target.dim, offset, length).contiguous()
        elif isinstance(source, Partial):
            if world > 1:
                local = _reduce_scatter(local, group, world, rank, target.dim, reduce_op_of(source))
        elif isinstance(source, Shard):
            size = _level_size(spec, current, mesh_dim, source.dim)
            local = _all_to_all(local, group, world, rank, source.dim, target.dim, size) if world > 1 else local
    elif isinstance(target, Partial):
        if not isinstance(source, Replicate):
            local = _step(local, spec, current, mesh_dim, Replicate())
        local = _partition(local, target, world, rank)
    current[mesh_dim] = target
    return local


def _direct_is_safe(current: Sequence[Placement], mesh_dim: int, target: Placement) -> bool:
    dims = {p.dim for p in (current[mesh_dim], target) if is_shard_like(p)}
    if isinstance(current[mesh_dim], Partial) and isinstance(target, Partial):
        return current[mesh_dim] == target
    return not _inner_shards(current, mesh_dim, dims)


def _direct_order(current: Sequence[Placement], placements: Sequence[Placement]) -> list[int] | None:
    """An order of the changing mesh dimensions in which every step can go straight to its target (none cuts
    into a later dimension's shards): last to first (unsharding inner levels first), else first to last
    (sharding outer levels first: ``(Partial, Partial) -> (Shard(0), Shard(0))`` is two reduce-scatters that
    way, where through Replicate it would be two all-reduces); None if neither works."""
    changing = [i for i in range(len(placements)) if current[i] != placements[i]]
    for order in (changing[::-1], changing):
        trial = list(current)
        for mesh_dim in order:
            if not _direct_is_safe(trial, mesh_dim, placements[mesh_dim]):
                break
            trial[mesh_dim] = placements[mesh_dim]
        else:
            return order
    return None


def redistribute_local_tensor(local: torch.Tensor, spec: DTensorSpec, placements: Sequence[Placement]) -> torch.Tensor:
    """This rank's block of ``spec``'s tensor laid out with ``placements`` instead, on the same mesh.

    Every rank of the mesh must call it with the same arguments (it runs collectives).
    """
    placements = tuple(placements)
    if spec.placements == placements or spec.mesh.get_coordinate() is None:
        return local
    current = list(spec.placements)
    order = _direct_order(current, placements)
    if order is not None:
        for mesh_dim in order:
            local = _step(local, spec, current, mesh_dim, placements[mesh_dim])
        return local
    # Through Replicate: unshard innermost first, then place outermost first.
    for mesh_dim in reversed(range(len(current))):  # unchanged shards too: they may sit inside a changing one
        if not isinstance(current[mesh_dim], Replicate) and (
                current[mesh_dim] != placements[mesh_dim] or is_shard_like(current[mesh_dim])):
            local = _step(local, spec, current, mesh_dim, Replicate())
    for mesh_dim in range(len(current)):
        if current[mesh_dim] != placements[mesh_dim]:
            local = _step(local, spec, current, mesh_dim, placements[mesh_dim])
    return local
