"""Shape ops: views and reshapes, transposes, expand, split/slice/select, cat.

A view maps groups of input dimensions onto groups of output dimensions whose
sizes multiply to the same number (``[6, 4] -> [2, 3, 4]``: ``{0} -> {0, 1}``,
``{1} -> {2}``). A shard survives when it sits on the first dimension of its
group and both that dimension and the output group's first dimension divide
evenly by the mesh dimension (the block is then a contiguous slice of the
group either way); a shard elsewhere in a group is replicated first, and an
uneven one is an error, as in PyTorch. Views are linear, so Partial passes
through. The size arguments of ``view``/``expand`` are global: each rank runs
the op with its block's sizes.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .._placements import Placement, Replicate, Shard
from .._spec import compute_local_shape_and_global_offset
from ._registry import OpCall, Plan, register

aten = torch.ops.aten

__all__ = ["view_groups"]

R = Replicate()


def view_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Groups (input dims, output dims) of equal element count; size-1 dims stand alone."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            groups.append(([i], []))
            i += 1
            continue
        if j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            groups.append(([], [j]))
            j += 1
            continue
        ins, outs = [i], [j]
        a, b = src[i], dst[j]
        i, j = i + 1, j + 1
        while a != b:
            if a < b:
                ins.append(i)
                a *= src[i]
                i += 1
            else:
                outs.append(j)
                b *= dst[j]
                j += 1
        groups.append((ins, outs))
    return groups


def _meta_out_shape(call: OpCall) -> torch.Size:
    from .._api import DTensor

    def meta(x):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta") if isinstance(x, DTensor) else x
    args = tuple(meta(a) for a in call.args)
    return call.func(*args, **call.kwargs).shape


def _map_view(call: OpCall, out_shape: Sequence[int]) -> tuple[tuple[Placement, ...], tuple[Placement, ...]]:
    """(input placements to use, output placements) of viewing the input as ``out_shape``."""
    spec = call.specs[0]
    src = list(spec.shape)
    if 0 in src or 0 in list(out_shape):
        rep = tuple(R for _ in spec.placements)
        return rep, rep
    groups = view_groups(src, list(out_shape))
    ins, outs = [], []
    level = list(src)  # sizes after the outer mesh dimensions' shards
    for mesh_dim, placement in enumerate(spec.placements):
        world = call.mesh.size(mesh_dim)
        if not isinstance(placement, Shard):
            ins.append(placement)
            outs.append(placement)
            continue
        d = placement.dim
        group = next(g for g in groups if d in g[0])
        group_in, group_out = group
        if len(group_in) == 1 and len(group_out) == 1:
            mapped: Placement | None = Shard(group_out[0])
        elif not group_out:
            mapped = R
        elif d != group_in[0]:
            # PyTorch keeps such a shard as a strided shard (torchdist replicates it), after the same checks.
            if level[d] % world == 0 and (len(group_out) == 1 or out_shape[group_out[0]] % world == 0):
                mapped = R
            else:
                mapped = None
        elif level[d] % world == 0 and out_shape[group_out[0]] % world == 0:
            mapped = Shard(group_out[0])
        else:
            mapped = None
        if mapped is None:
            where = (f"\n({call.func} on rank {call.mesh.get_rank()}: redistribute to Replicate on mesh dimension "
                     f"{mesh_dim}, or shard a dimension that divides evenly)")
            if len(group_in) > 1 and level[d] % world:
                raise RuntimeError(
                    f"Cannot flatten unevenly sharded tensor: dimension {d} (size {level[d]}) is not evenly divisible "
                    f"by mesh dimension {mesh_dim} (size {world}). Please redistribute the tensor before this "
                    f"operation.{where}")
            raise RuntimeError(
                f"Cannot unflatten unevenly sharded tensor: output dimension 0 (size {out_shape[group_out[0]]}) is "
                f"not evenly divisible by mesh dimension {mesh_dim} (size {world}). Please redistribute the tensor "
                f"before this operation.{where}")
        ins.append(placement if isinstance(mapped, Shard) else R)
        outs.append(mapped)
        if isinstance(mapped, Shard):
            level[d] = -(-level[d] // world)
    return tuple(ins), tuple(outs)


def _with_local_size(index: int, local_shape: tuple[int, ...]):
    def rewrite(args, kwargs):
        args = list(args)
        args[index] = list(local_shape)
        return tuple(args), kwargs
    return rewrite


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def view_rule(call: OpCall) -> Plan:
    out_shape = _meta_out_shape(call)
    ins, outs = _map_view(call, out_shape)
    local_shape, _ = compute_local_shape_and_global_offset(out_shape, call.mesh, outs)
    return Plan([ins], [outs], {"rewrite": _with_local_size(1, local_shape)})


@register(aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def squeeze_rule(call: OpCall) -> Plan:
    ins, outs = _map_view(call, _meta_out_shape(call))
    return Plan([ins], [outs])


@register(aten.expand.default)
def expand_rule(call: OpCall) -> Plan:
    spec = call.specs[0]
    out_shape = _meta_out_shape(call)
    offset = len(out_shape) - spec.ndim
    ins, outs = [], []
    for placement in spec.placements:
        if isinstance(placement, Shard) and spec.shape[placement.dim] != out_shape[placement.dim + offset]:
            placement = R  # a broadcast dimension cannot stay split
        ins.append(placement)
        outs.append(Shard(placement.dim + offset) if isinstance(placement, Shard) else placement)
    local_shape, _ = compute_local_shape_and_global_offset(out_shape, call.mesh, outs)
    return Plan([tuple(ins)], [tuple(outs)], {"rewrite": _with_local_size(1, local_shape)})


def _permuted(call: OpCall, order: Sequence[int]) -> Plan:
    spec = call.specs[0]
    where = {src: dst for dst, src in enumerate(order)}
    outs = tuple(Shard(where[p.dim]) if isinstance(p, Shard) else p for p in spec.placements)
    return Plan([spec.placements], [outs])


@register(aten.t.default)
def t_rule(call: OpCall) -> Plan:
    return _permuted(call, list(reversed(range(call.specs[0].ndim))))


@register(aten.transpose.int)
def transpose_rule(call: OpCall) -> Plan:
    ndim = call.specs[0].ndim
    a, b = call.arg(1, "dim0") % ndim, call.arg(2, "dim1") % ndim
    order = list(range(ndim))
    order[a], order[b] = order[b], order[a]
    return _permuted(call, order)


@register(aten.permute.default)
def permute_rule(call: OpCall) -> Plan:
    ndim = call.specs[0].ndim
    return _permuted(call, [d % ndim for d in call.arg(1, "dims")])


def _along_dim(call: OpCall, dim: int, removes: bool, num_outputs: int) -> Plan:
    """Ops that cut along ``dim`` (split, slice, select): that dim must be whole; others keep their shards."""
    spec = call.specs[0]
    ins = tuple(R if isinstance(p, Shard) and p.dim == dim else p for p in spec.placements)
    outs = tuple(Shard(p.dim - 1) if removes and isinstance(p, Shard) and p.dim > dim else p for p in ins)
    return Plan([ins], [outs] * num_outputs)


@register(aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int)
def split_rule(call: OpCall) -> Plan:
    spec = call.specs[0]
    dim = call.arg(2 if call.func is not aten.unbind.int else 1, "dim", 0) % max(spec.ndim, 1)
    pieces = len(call.func(torch.empty_strided(spec.shape, spec.stride, device="meta"), *call.args[1:],
                           **call.kwargs))
    return _along_dim(call, dim, call.func is aten.unbind.int, pieces)


@register(aten.slice.Tensor)
def slice_rule(call: OpCall) -> Plan:
    return _along_dim(call, call.arg(1, "dim", 0) % max(call.specs[0].ndim, 1), False, 1)


@register(aten.select.int)
def select_rule(call: OpCall) -> Plan:
    return _along_dim(call, call.arg(1, "dim") % max(call.specs[0].ndim, 1), True, 1)


@register(aten.cat.default)
def cat_rule(call: OpCall) -> Plan:
    """Every input takes the first input's layout, with the concatenated dimension whole."""
    first = call.specs[0]
    dim = call.arg(1, "dim", 0) % max(first.ndim, 1)
    target = tuple(R if isinstance(p, Shard) and p.dim == dim else p for p in first.placements)
    shape = list(first.shape)
    shape[dim] = sum(spec.shape[dim] for spec in call.specs if spec.ndim == first.ndim)
    return Plan([target] * len(call.specs), [target], {"shapes": [torch.Size(shape)]})


@register(aten.stack.default)
def stack_rule(call: OpCall) -> Plan:
    """Every input takes the first input's layout; the new dimension shifts the shards after it."""
    first = call.specs[0]
    dim = call.arg(1, "dim", 0) % (first.ndim + 1)
    target = first.placements
    outs = tuple(Shard(p.dim + 1) if isinstance(p, Shard) and p.dim >= dim else p for p in target)
    shape = list(first.shape)
    shape.insert(dim, len(call.specs))
    return Plan([target] * len(call.specs), [outs], {"shapes": [torch.Size(shape)]})
