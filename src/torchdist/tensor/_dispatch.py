"""``__torch_dispatch__`` of DTensor: pick placements, move the inputs, run the op locally, wrap the outputs.

::

    aten op on DTensors ─► OpCall (specs of the DTensor arguments; plain tensors must be scalars)
        ─► rule (``_ops``): Plan = placements of each input and of each output
        ─► redistribute the inputs that differ (collectives)  ─► op on the local blocks
        ─► outputs wrapped as DTensors; global shapes from the rule, else from the op run on meta tensors

An in-place op returns its self argument, which keeps its placements unless no
rule allows that (then, as in PyTorch, it takes the new ones: ``zero_`` on a Partial).
Ops with no rule run on replicated inputs and return Replicate DTensors (a
warning names the op once): correct for any op, at the cost of gathering.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ._api import DTensor
from ._ops import RULES, OpCall, Plan
from ._ops._pointwise import foreach_rule, is_pointwise, is_pointwise_foreach, pointwise_rule
from ._ops._registry import CUSTOM_RULES, replicate_all
from ._special import SPECIAL
from ._placements import Replicate, Shard
from ._redistribute import redistribute_local_tensor
from ._spec import DTensorSpec, TensorMeta, contiguous_strides, global_shape_from_local

aten = torch.ops.aten

__all__ = ["dispatch", "run_with_rule_or_fallback", "collect", "implicit_replication_enabled",
           "set_implicit_replication"]

_warned_fallback: set = set()
_implicit_replication = [False]


def implicit_replication_enabled() -> bool:
    return _implicit_replication[0]


def set_implicit_replication(enabled: bool) -> bool:
    previous = _implicit_replication[0]
    _implicit_replication[0] = enabled
    return previous


def collect(func, leaves: list) -> tuple[list[int], Any]:
    """Positions of the DTensor leaves and their common mesh; plain tensors must be scalar-like."""
    positions, mesh = [], None
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, DTensor):
            positions.append(i)
            if mesh is None:
                mesh = leaf.device_mesh
            elif leaf.device_mesh != mesh:
                raise NotImplementedError(f"DTensor does not support cross-mesh operation on {func} yet! Got meshes: "
                                          f"{mesh} {leaf.device_mesh}")
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and not isinstance(leaf, DTensor):
            if leaf.numel() == 1 and leaf.ndim == 0:
                continue
            if leaf.numel() == 1:
                warnings.warn("Found a non-scalar tensor with numel=1 and ndim!=0, we are implicitly creating a "
                              "replicated DTensor for it. However, please consider changing it to a scalar tensor "
                              "or explicitly create a DTensor under distributed enviroment.", stacklevel=3)
                continue
            raise RuntimeError(f"{func} got mixed torch.Tensor and DTensor, need to convert all torch.Tensor to "
                               "DTensor before calling distributed operators!")
    return positions, mesh


def _replicate_plain_tensors(leaves: list) -> list:
    """Under ``implicit_replication()``: plain tensors (not scalars) become Replicate DTensors on the op's mesh."""
    mesh = next((leaf.device_mesh for leaf in leaves if isinstance(leaf, DTensor)), None)
    if mesh is None:
        return leaves
    replicate = tuple(Replicate() for _ in range(mesh.ndim))
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and not isinstance(leaf, DTensor) and leaf.ndim > 0:
            spec = DTensorSpec(mesh, replicate, TensorMeta(leaf.shape, leaf.stride(), leaf.dtype))
            leaf = DTensor(leaf.detach(), spec, requires_grad=False)
        out.append(leaf)
    return out


def _rule_for(func):
    rule = CUSTOM_RULES.get(func) or RULES.get(func)
    if rule is not None:
        return rule
    if func._schema.name.startswith("aten::_foreach_"):
        return foreach_rule if is_pointwise_foreach(func) else None
    if is_pointwise(func):
        return pointwise_rule
    return None


def _to_meta(leaf: Any) -> Any:
    if isinstance(leaf, DTensor):
        return torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype, device="meta")
    if isinstance(leaf, torch.Tensor):
        return leaf.to("meta")
    return leaf


def _strides_like(local: torch.Tensor, shape: torch.Size) -> tuple[int, ...]:
    """Strides for the global ``shape`` that lay dimensions out in the order the local block has them."""
    if local.is_contiguous():
        return contiguous_strides(shape)
    order = sorted(range(local.ndim), key=lambda d: (-local.stride(d), d))
    inner = contiguous_strides([shape[d] for d in order])
    strides = [0] * local.ndim
    for position, d in enumerate(order):
        strides[d] = inner[position]
    return tuple(strides)


def _global_metas(func, mesh, leaves, spec_tree, outputs: list[torch.Tensor], placements,
                  shapes: list | None) -> list[TensorMeta]:
    """Global shape/stride/dtype of each tensor output: the local ones where nothing is sharded, else the shapes
    the rule worked out, else from running the op on meta tensors (which costs a first-call import of torch._dynamo
    for ops whose meta kernels are Python, hence the rules' shapes)."""
    if not any(isinstance(p, Shard) for ps in placements for p in ps):
        return [TensorMeta(t.shape, t.stride(), t.dtype) for t in outputs]
    if shapes is not None and len(shapes) == len(outputs):
        return [TensorMeta(torch.Size(s), _strides_like(t, torch.Size(s)), t.dtype) for s, t in zip(shapes, outputs)]
    try:
        args, kwargs = tree_unflatten([_to_meta(leaf) for leaf in leaves], spec_tree)
        meta_out = [t for t in tree_flatten(func(*args, **kwargs))[0] if isinstance(t, torch.Tensor)]
        return [TensorMeta(m.shape, m.stride(), t.dtype) for m, t in zip(meta_out, outputs)]
    except (NotImplementedError, RuntimeError):  # no meta kernel: assume even shards
        metas = []
        for t, ps in zip(outputs, placements):
            shape, stride = global_shape_from_local(t, mesh, ps)
            metas.append(TensorMeta(shape, stride, t.dtype))
        return metas



def dispatch(func, args: tuple, kwargs: dict) -> Any:
    """DTensor's ``__torch_dispatch__``: an op answered specially, or run through its rule (or the fallback)."""
    special = SPECIAL.get(func)
    if special is not None and func not in CUSTOM_RULES:  # a user's register_sharding wins over everything
        return special(func, args, kwargs)
    return run_with_rule_or_fallback(func, args, kwargs)


def run_with_rule_or_fallback(func, args: tuple, kwargs: dict) -> Any:
    leaves, spec_tree = tree_flatten((args, kwargs))
    if implicit_replication_enabled():
        leaves = _replicate_plain_tensors(leaves)
    positions, mesh = collect(func, leaves)
    dtensors: list[DTensor] = [leaves[i] for i in positions]
    call = OpCall(func, args, kwargs, [d._spec for d in dtensors], mesh)
    rule = _rule_for(func)
    if rule is None:
        return _fallback(call, leaves, spec_tree, positions, dtensors)
    plan = rule(call)
    return _run(call, plan, leaves, spec_tree, positions, dtensors)


def _run(call: OpCall, plan: Plan, leaves, spec_tree, positions, dtensors) -> Any:
    local_leaves = list(leaves)
    unchanged: dict[int, DTensor] = {}  # id(local tensor passed) -> the DTensor it still is
    first = call.args[0] if call.args else None
    num_self = (len(first) if isinstance(first, (list, tuple)) else 1) if call.inplace else 0  # leading leaves
    for pos, dtensor, placements in zip(positions, dtensors, plan.inputs):
        local = dtensor._local_tensor
        if placements != dtensor.placements:
            local = redistribute_local_tensor(local, dtensor._spec, placements)
            if pos < num_self:  # as in PyTorch, an in-place op's self takes the new layout (zero_ on a Partial)
                dtensor._local_tensor = local
                dtensor._spec = dtensor._spec.with_placements(placements)
                unchanged[id(local)] = dtensor
        else:
            unchanged[id(local)] = dtensor
        local_leaves[pos] = local
    args, kwargs = tree_unflatten(local_leaves, spec_tree)
    rewrite = plan.extra.get("rewrite")
    if rewrite is not None:  # e.g. view/expand: global sizes in the arguments become this rank's block's sizes
        args, kwargs = rewrite(args, kwargs)
    result = call.func(*args, **kwargs)
    flat, out_tree = tree_flatten(result)
    tensor_slots = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor)]
    fresh = [i for i in tensor_slots if id(flat[i]) not in unchanged]  # in-place results are their DTensors
    every = plan.extra.get("every_output")
    if every is not None:  # the fallback: however many outputs there are, all replicated
        plan = Plan(plan.inputs, [every] * len(fresh), plan.extra)
    if len(plan.outputs) < len(fresh):
        raise AssertionError(f"{call.func}: the sharding rule gave {len(plan.outputs)} output placements for "
                             f"{len(fresh)} outputs")
    out_placements = {i: plan.outputs[k] for k, i in enumerate(fresh)}
    metas = _global_metas(call.func, call.mesh, leaves, spec_tree, [flat[i] for i in fresh],
                          [out_placements[i] for i in fresh], plan.extra.get("shapes"))
    for k, i in enumerate(fresh):
        flat[i] = DTensor(flat[i], DTensorSpec(call.mesh, out_placements[i], metas[k]), requires_grad=False)
    for i in tensor_slots:
        if i not in out_placements:
            flat[i] = unchanged[id(flat[i])]
    return tree_unflatten(flat, out_tree)


def _fallback(call: OpCall, leaves, spec_tree, positions, dtensors) -> Any:
    """Any op: replicate the DTensor arguments, run it, return Replicate DTensors; write back in-place results."""
    if call.func not in _warned_fallback:
        _warned_fallback.add(call.func)
        warnings.warn(f"torchdist.tensor: {call.func} has no sharding rule; its DTensor arguments are replicated "
                      "(all-gathered) and it runs on the whole tensors on every rank", UserWarning, stacklevel=3)
    plan = replicate_all(call, 0)
    plan.extra["every_output"] = tuple(Replicate() for _ in range(call.mesh.ndim))
    mutated = [k for k, arg in enumerate(call.func._schema.arguments) if arg.alias_info is not None
               and arg.alias_info.is_write]
    if not mutated:
        return _run(call, plan, leaves, spec_tree, positions, dtensors)
    # In-place: compute on replicated copies, then put each mutated DTensor's block back in its own layout.
    local_leaves = list(leaves)
    for pos, dtensor in zip(positions, dtensors):
        local_leaves[pos] = redistribute_local_tensor(dtensor._local_tensor, dtensor._spec, plan.inputs[0])
        if local_leaves[pos] is dtensor._local_tensor:
            local_leaves[pos] = dtensor._local_tensor.clone()
    args, kwargs = tree_unflatten(local_leaves, spec_tree)
    call.func(*args, **kwargs)
    for pos, dtensor in zip(positions, dtensors):
        rep_spec = dtensor._spec.with_placements(plan.inputs[0])
        dtensor._local_tensor.copy_(redistribute_local_tensor(local_leaves[pos], rep_spec, dtensor.placements))
    return call.args[0] if len(call.func._schema.returns) == 1 else None
