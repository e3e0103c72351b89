"""DTensor ops that the sharding rules (``_ops``) do not cover: a ``_StridedShard`` argument, and foreach ops
over DTensors on several meshes.

The rules know Shard, Replicate and Partial. An op on DTensors that share one strided layout and combine element
by element (an optimizer's foreach update, ``copy_``, ``zeros_like``) runs on the local blocks and keeps that
layout, as PyTorch's rules do; any other op sees the strided mesh dims replicated first, and what it mutates is
written back in the strided layout. A foreach op over parameters on different meshes (2-D FSDP + TP parameters
next to FSDP-only ones in one optimizer) runs locally when each index's tensors share a layout, else one call per
index.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ._api import DTensor
from ._placements import Replicate, _StridedShard
from ._redistribute import redistribute_local_tensor
from ._spec import DTensorSpec, TensorMeta, contiguous_strides

__all__ = ["has_strided", "dispatch_strided", "dispatch_foreach_by_index"]

_LAYOUT_KEEPING = {torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.clone.default,
                   torch.ops.aten._to_copy.default, torch.ops.aten.lift_fresh.default,
                   torch.ops.aten.empty_like.default, torch.ops.aten.zeros_like.default,
                   torch.ops.aten.ones_like.default, torch.ops.aten.full_like.default,
                   torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default, torch.ops.aten.copy_.default}


def has_strided(spec: DTensorSpec) -> bool:
    return any(isinstance(p, _StridedShard) for p in spec.placements)


def _elementwise(func) -> bool:
    from ._ops._pointwise import is_pointwise, is_pointwise_foreach

    if func in _LAYOUT_KEEPING:
        return True
    if func._schema.name.startswith("aten::_foreach_"):
        return is_pointwise_foreach(func)
    return is_pointwise(func)


def _same_layout_groups(func, args: tuple, kwargs: dict) -> list[list[DTensor]] | None:
    """The DTensors that combine element by element (all of them; for a foreach op, the i-th of each list), if each
    group shares one mesh, shape and placements without Partial and every other tensor is a scalar; else None."""
    if not _elementwise(func):
        return None
    leaves = tree_flatten((args, kwargs))[0]
    if any(isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.dim() > 0 for x in leaves):
        return None
    if func._schema.name.startswith("aten::_foreach_"):
        lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
        if sum(isinstance(x, DTensor) for x in leaves) != sum(isinstance(x, DTensor) for a in lists for x in a):
            return None  # a DTensor outside the lists (a tensor learning rate): let the rules decide
        groups = [[a[i] for a in lists if isinstance(a[i], DTensor)] for i in range(len(lists[0]))]
    else:
        groups = [[x for x in leaves if isinstance(x, DTensor)]]
    for group in groups:
        first = group[0]._spec
        if first.has_partial() or any(d._spec.mesh != first.mesh or d._spec.placements != first.placements or
                                      d.shape != first.shape for d in group):
            return None
    return groups


def _run_local(func, args: tuple, kwargs: dict, groups: list[list[DTensor]]) -> Any:
    """Run ``func`` on the local blocks; new outputs take their group's layout, in-place ones stay their DTensor."""
    local_of = {id(d._local_tensor): d for group in groups for d in group}
    local_args, local_kwargs = tree_map(lambda x: x._local_tensor if isinstance(x, DTensor) else x, (args, kwargs))
    result = func(*local_args, **local_kwargs)
    flat, tree = tree_flatten(result)
    fresh = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and id(t) not in local_of]
    for k, i in enumerate(fresh):
        spec = groups[k if len(groups) > 1 else 0][0]._spec
        meta = TensorMeta(spec.shape, contiguous_strides(spec.shape), flat[i].dtype)
        flat[i] = DTensor(flat[i], DTensorSpec(spec.mesh, spec.placements, meta), requires_grad=False)
    flat = [local_of.get(id(t), t) if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t
            for t in flat]
    return tree_unflatten(flat, tree)


def _unstrided(dtensor: DTensor) -> DTensor:
    """The same tensor with its _StridedShard mesh dims replicated (an all-gather on each)."""
    placements = tuple(Replicate() if isinstance(p, _StridedShard) else p for p in dtensor.placements)
    local = redistribute_local_tensor(dtensor._local_tensor, dtensor._spec, placements)
    return DTensor(local, dtensor._spec.with_placements(placements), requires_grad=False)


def dispatch_foreach_by_index(func, args: tuple, kwargs: dict) -> Any:
    """A foreach op over DTensors on several meshes (2-D FSDP + TP parameters next to FSDP-only ones in one
    optimizer): locally if each index's tensors share a layout, else one call per index (each on one mesh)."""
    groups = _same_layout_groups(func, args, kwargs)
    if groups is not None:
        return _run_local(func, args, kwargs, groups)
    count = len(args[0])
    per_index = [i for i, a in enumerate(args) if isinstance(a, (list, tuple)) and len(a) == count]
    results = [func(*[[a[k]] if i in per_index else a for i, a in enumerate(args)], **kwargs) for k in range(count)]
    return None if results[0] is None else [out for result in results for out in result]


def dispatch_strided(func, args: tuple, kwargs: dict) -> Any:
    """An op with a _StridedShard DTensor argument: locally when the layouts allow it, else on unstrided copies,
    whose new values are written back into the arguments the op mutates."""
    from ._dispatch import dispatch

    groups = _same_layout_groups(func, args, kwargs)
    if groups is not None:
        return _run_local(func, args, kwargs, groups)
    meshes = {x.device_mesh for x in tree_flatten((args, kwargs))[0] if isinstance(x, DTensor)}
    if func._schema.name.startswith("aten::_foreach_") and len(meshes) > 1 and len(args[0]) > 1:
        return dispatch_foreach_by_index(func, args, kwargs)
    stand_ins: dict[int, tuple[DTensor, DTensor]] = {}  # id(stand-in) -> (stand-in, original)

    def swap(x: Any) -> Any:
        if isinstance(x, DTensor) and has_strided(x._spec):
            stand_in = _unstrided(x)
            stand_ins[id(stand_in)] = (stand_in, x)
            return stand_in
        return x

    swapped_args, swapped_kwargs = tree_map(swap, (args, kwargs))
    result = dispatch(func, swapped_args, swapped_kwargs)
    for stand_in in _mutated(func, swapped_args, swapped_kwargs):
        if id(stand_in) in stand_ins:
            original = stand_ins[id(stand_in)][1]
            original._local_tensor.copy_(redistribute_local_tensor(stand_in._local_tensor, stand_in._spec,
                                                                   original.placements))
    return tree_map(lambda x: stand_ins[id(x)][1] if isinstance(x, DTensor) and id(x) in stand_ins else x, result)


def _mutated(func, args: tuple, kwargs: dict) -> list[DTensor]:
    """The DTensors ``func`` writes into (its arguments marked mutable in the schema)."""
    found = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        found.extend(x for x in tree_flatten(value)[0] if isinstance(x, DTensor))
    return found
