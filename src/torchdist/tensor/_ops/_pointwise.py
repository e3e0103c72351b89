"""Pointwise ops (every aten op tagged ``pointwise``, their in-place forms, and the ``_foreach_`` lists).

Candidates on one mesh dimension: all Replicate; for each output dimension e,
Shard(e) with every input sharded on the dimension that broadcasts to e
(Replicate where it is broadcast); and the Partial rules of the op's linearity
(PyTorch's): ``add``/``sub`` keep P(sum)+P(sum), P(avg)+R, P(max/min)+R;
``mul`` keeps P(sum|avg) times R on either side, ``div`` only in the numerator;
scaling by a Python number and ``neg`` keep P(sum|avg) (``neg`` swaps max and
min); casts and ``copy_`` keep any Partial.
"""

from __future__ import annotations

import torch

from .._placements import Partial, Placement, Replicate, Shard
from .._spec import DTensorSpec
from ._registry import DimRule, OpCall, Plan, choose

aten = torch.ops.aten

__all__ = ["pointwise_rule", "pointwise_candidates", "foreach_rule", "is_pointwise", "is_pointwise_foreach"]


def _p(op: str) -> Partial:
    return Partial(op)


R = Replicate()
_UNARY_LINEAR = [((_p("sum"),), (_p("sum"),)), ((_p("avg"),), (_p("avg"),))]
_ALL_PARTIAL_UNARY = [((_p(r),), (_p(r),)) for r in ("sum", "avg", "max", "min")]
_ADDITIVE = [((_p("sum"),), (_p("sum"), _p("sum"))), ((_p("avg"),), (_p("avg"), _p("avg"))),
             ((_p("avg"),), (_p("avg"), R)), ((_p("max"),), (_p("max"), R)), ((_p("min"),), (_p("min"), R)),
             ((_p("avg"),), (R, _p("avg")))]
_MUL = _UNARY_LINEAR + [((_p("sum"),), (_p("sum"), R)), ((_p("avg"),), (_p("avg"), R)),
                        ((_p("sum"),), (R, _p("sum"))), ((_p("avg"),), (R, _p("avg")))]
_DIV = _UNARY_LINEAR + [((_p("sum"),), (_p("sum"), R)), ((_p("avg"),), (_p("avg"), R))]
_NEG = _UNARY_LINEAR + [((_p("min"),), (_p("max"),)), ((_p("max"),), (_p("min"),))]
_COPY = [((_p(r),), (_p(r), _p(r))) for r in ("sum", "avg", "max", "min")]

# Partial rules by op name (overload-independent; a rule applies when its input count matches the call's).
_PARTIAL_RULES = {
    "add": _ADDITIVE, "sub": _ADDITIVE, "mul": _MUL, "div": _DIV, "neg": _NEG, "to": _ALL_PARTIAL_UNARY,
    "positive": _ALL_PARTIAL_UNARY, "copy": _COPY, "_to_copy": _ALL_PARTIAL_UNARY,
}
# Overloads whose Partial rules differ from their name's: a Python number makes add/sub non-linear.
_SCALAR_OVERLOADS = {"Scalar", "ScalarList"}


def _base_name(func) -> str:
    name = func._schema.name.split("::")[1]
    if name.startswith("_foreach_"):
        name = name[len("_foreach_"):]
    return name.rstrip("_") if name not in ("_to_copy",) else name


def partial_rules(func, num_inputs: int) -> list[tuple[tuple[Placement, ...], tuple[Placement, ...]]]:
    name = _base_name(func)
    rules = _PARTIAL_RULES.get(name, [])
    if name in ("add", "sub") and func._overloadname in _SCALAR_OVERLOADS:
        rules = []
    return [rule for rule in rules if len(rule[1]) == num_inputs]


_UNTAGGED_POINTWISE = {"floor_divide", "floor_divide_", "native_dropout_backward"}


def is_pointwise(func) -> bool:
    """Tagged pointwise, or an overload (not ``out=``) of an op whose other overloads are (``true_divide.Scalar``),
    or the backward of a pointwise op."""
    if torch.Tag.pointwise in func.tags:
        return True
    if "out" in func._overloadname:
        return False
    name = func._schema.name.split("::")[1]
    if name in _UNTAGGED_POINTWISE:
        return True
    if name.endswith("_backward"):  # the derivative of a pointwise op is pointwise (elu_backward, ...)
        name = name[: -len("_backward")]
    packet = getattr(aten, name, None)
    return packet is not None and any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())


def is_pointwise_foreach(func) -> bool:
    """Whether a ``_foreach_`` op applies a pointwise op item by item (``_foreach_norm`` and ``_foreach_mm`` do not)."""
    packet = getattr(aten, _base_name(func), None)
    return packet is not None and any(torch.Tag.pointwise in getattr(packet, name).tags for name in packet.overloads())


def pointwise_candidates(shapes: list[torch.Size], out_shape: torch.Size, num_outputs: int,
                         partials: list, any_shard: bool = True) -> list[DimRule]:
    """One-mesh-dimension candidates of a broadcasting pointwise op with inputs of ``shapes``."""
    candidates = []
    ndim = len(out_shape) if any_shard else 0  # as PyTorch: shard candidates only where an input is sharded
    for dim in range(ndim):
        ins: list[Placement] = []
        for shape in shapes:
            in_dim = dim - (ndim - len(shape))
            broadcast = in_dim < 0 or (shape[in_dim] == 1 and out_shape[dim] != 1)
            ins.append(R if broadcast else Shard(in_dim))
        candidates.append(DimRule((Shard(dim),) * num_outputs, tuple(ins)))
    for outs, ins in partials:
        candidates.append(DimRule(outs * num_outputs, ins))
    candidates.append(DimRule((R,) * num_outputs, (R,) * len(shapes)))  # last: ties go to keeping shards
    return candidates


def _num_tensor_returns(func) -> int:
    return sum(1 for r in func._schema.returns if "Tensor" in str(r.type)) or 1


def pointwise_rule(call: OpCall) -> Plan:
    specs = call.specs
    out_shape = torch.broadcast_shapes(*[s.shape for s in specs])
    num_outputs = _num_tensor_returns(call.func)
    candidates = pointwise_candidates([s.shape for s in specs], out_shape, num_outputs,
                                      partial_rules(call.func, len(specs)), _any_shard(specs))
    fixed = 0 if call.inplace and _first_arg_is_dtensor(call) else None
    ins, outs = choose(call, specs, candidates, fixed=fixed)
    return Plan(ins, outs, {"shapes": [out_shape] * num_outputs})


def _any_shard(specs: list[DTensorSpec]) -> bool:
    return any(p.is_shard() for spec in specs for p in spec.placements)


def _first_arg_is_dtensor(call: OpCall) -> bool:
    from .._api import DTensor

    return isinstance(call.args[0], DTensor) if call.args else False


def foreach_rule(call: OpCall) -> Plan:
    """``_foreach_op(list, list | scalar | ...)``: the pointwise rule applied index by index."""
    from .._api import DTensor

    # Where each DTensor sits in the flattened arguments (pytree order: argument by argument, list items in order).
    index_of: dict[tuple[int, int], int] = {}
    counter = 0
    for a, arg in enumerate(call.args):
        for e, item in enumerate(arg if isinstance(arg, (list, tuple)) else [arg]):
            if isinstance(item, DTensor):
                index_of[(a, e)] = counter
                counter += 1
    lists = [a for a, arg in enumerate(call.args)
             if isinstance(arg, (list, tuple)) and arg and isinstance(arg[0], torch.Tensor)]
    inplace = call.func._schema.name.endswith("_")
    rep = tuple(Replicate() for _ in range(call.mesh.ndim))
    inputs = [rep] * len(call.specs)  # tensors outside the lists (a scalar DTensor such as a learning rate)
    outs: list[tuple[Placement, ...]] = []
    shapes: list[torch.Size] = []
    for i in range(len(call.args[lists[0]])):
        keys = [(a, i) for a in lists if (a, i) in index_of]
        specs: list[DTensorSpec] = [call.specs[index_of[key]] for key in keys]
        if not specs:
            continue
        out_shape = torch.broadcast_shapes(*[s.shape for s in specs])
        candidates = pointwise_candidates([s.shape for s in specs], out_shape, 1,
                                          partial_rules(call.func, len(specs)), _any_shard(specs))
        fixed = 0 if inplace and keys[0] == (lists[0], i) else None
        item_ins, item_outs = choose(call, specs, candidates, fixed=fixed)
        for key, placements in zip(keys, item_ins):
            inputs[index_of[key]] = placements
        outs.append(item_outs[0])
        shapes.append(out_shape)
    return Plan(inputs, [] if inplace else outs, {"shapes": shapes})
