"""Reductions, softmax and the negative log-likelihood loss.

Reducing a sharded dimension leaves each rank a partial result: ``sum`` gives
Partial(sum), ``amax``/``max`` Partial(max), ``amin``/``min`` Partial(min),
``mean`` Partial(avg) when the shards are even (uneven shards would weigh the
ranks wrongly, so the input is replicated first, as in PyTorch). Dimensions
kept keep their shards (renumbered when ``keepdim`` is False); Partial inputs
stay Partial where the reduction is linear for that op. ``softmax`` needs its
dimension whole; ``nll_loss`` runs on replicated inputs.
"""

from __future__ import annotations

import math

import torch

from .._placements import Partial, Replicate, Shard
from ._registry import DimRule, OpCall, Plan, choose, register

aten = torch.ops.aten

__all__: list[str] = []

R = Replicate()
_PRESERVED = {"sum": ("sum", "avg"), "avg": ("sum", "avg"), "max": ("max",), "min": ("min",)}


def _reduced_dims(call: OpCall, ndim: int) -> list[int]:
    schema_names = [a.name for a in call.func._schema.arguments]
    dims = call.arg(1, "dim") if "dim" in schema_names else None
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({d % max(ndim, 1) for d in dims})


def _reduction(partial_op: str):
    def rule(call: OpCall) -> Plan:
        spec = call.specs[0]
        ndim = spec.ndim
        dims = _reduced_dims(call, ndim)
        schema_names = [a.name for a in call.func._schema.arguments]
        keepdim = bool(call.arg(2, "keepdim", False)) if "keepdim" in schema_names else False
        candidates = []
        for d in range(ndim):
            if d in dims:
                even = spec.shape[d] % math.prod(call.mesh.shape) == 0  # even at every level of nested shards
                if partial_op != "avg" or even:
                    candidates.append(DimRule((Partial(partial_op),), (Shard(d),)))
            else:
                out_dim = d if keepdim else d - sum(1 for r in dims if r < d)
                candidates.append(DimRule((Shard(out_dim),), (Shard(d),)))
        for op in _PRESERVED[partial_op]:
            candidates.append(DimRule((Partial(op),), (Partial(op),)))
        candidates.append(DimRule((R,), (R,)))
        ins, outs = choose(call, call.specs[:1], candidates)
        shape = [1 if d in dims else n for d, n in enumerate(spec.shape) if keepdim or d not in dims]
        return Plan(ins, outs, {"shapes": [torch.Size(shape)]})
    return rule


register(aten.sum.default, aten.sum.dim_IntList)(_reduction("sum"))
register(aten.mean.default, aten.mean.dim)(_reduction("avg"))
register(aten.amax.default, aten.max.default)(_reduction("max"))
register(aten.amin.default, aten.min.default)(_reduction("min"))


def _whole_dim_rule(call: OpCall) -> Plan:
    """Ops that need one dimension whole (softmax and its backward): any other dimension may stay sharded."""
    dim = call.arg(2 if call.func in _BACKWARD_SOFTMAX else 1, "dim") % max(call.specs[0].ndim, 1)
    n = len(call.specs)
    # Only shards the inputs already have: moving a shard off ``dim`` costs as much as replicating, as PyTorch counts.
    present = {p.dim for spec in call.specs for p in spec.placements if isinstance(p, Shard)}
    candidates = [DimRule((Shard(d),), (Shard(d),) * n) for d in sorted(present) if d != dim]
    candidates.append(DimRule((R,), (R,) * n))
    ins, outs = choose(call, call.specs, candidates)
    return Plan(ins, outs, {"shapes": [call.specs[0].shape]})


_BACKWARD_SOFTMAX = {aten._softmax_backward_data.default, aten._log_softmax_backward_data.default}
register(aten._softmax.default, aten._log_softmax.default, *_BACKWARD_SOFTMAX)(_whole_dim_rule)


@register(aten.nll_loss_forward.default, aten.nll_loss_backward.default, aten.nll_loss2d_forward.default,
          aten.nll_loss2d_backward.default)
def replicated_rule(call: OpCall) -> Plan:
    """Runs on whole tensors (no warning: this is the rule, not the fallback)."""
    rep = tuple(R for _ in range(call.mesh.ndim))
    num_outputs = sum(1 for r in call.func._schema.returns if "Tensor" in str(r.type))
    return Plan([rep] * len(call.specs), [rep] * num_outputs)


@register(aten.native_layer_norm.default)
def layer_norm_rule(call: OpCall) -> Plan:
    """Normalizing the trailing dims needs them whole; leading (batch, sequence) dims may stay sharded."""
    x = call.specs[0]
    normalized = len(call.arg(1, "normalized_shape"))
    axis = x.ndim - normalized
    params = len(call.specs) - 1  # weight and bias, where they are DTensors
    candidates = [DimRule((Shard(d),) * 3, (Shard(d),) + (R,) * params) for d in range(axis)]
    candidates.append(DimRule((R,) * 3, (R,) * (1 + params)))
    ins, outs = choose(call, call.specs, candidates)
    stats = torch.Size(list(x.shape[:axis]) + [1] * normalized)
    return Plan(ins, outs, {"shapes": [x.shape, stats, stats]})


@register(aten.native_layer_norm_backward.default)
def layer_norm_backward_rule(call: OpCall) -> Plan:
    """grad_input follows the input's leading-dim shards; weight/bias gradients are then partial sums."""
    x = call.specs[1]
    axis = x.ndim - len(call.arg(2, "normalized_shape"))
    params = len(call.specs) - 4
    mask = list(call.arg(7, "output_mask"))
    candidates = [DimRule((Shard(d), Partial(), Partial()), (Shard(d),) * 4 + (R,) * params) for d in range(axis)]
    candidates.append(DimRule((R,) * 3, (R,) * (4 + params)))
    ins, outs = choose(call, call.specs, candidates)
    shapes = [x.shape, call.specs[-2].shape if params == 2 else None, call.specs[-1].shape if params == 2 else None]
    keep = [k for k in range(3) if mask[k]]
    extra = {"shapes": [shapes[k] for k in keep]} if all(shapes[k] is not None for k in keep) else {}
    return Plan(ins, [outs[k] for k in keep], extra)
