"""Matrix products and embeddings: the layouts that need no communication, and what they produce.

``mm(A[m,k], B[k,n])`` on one mesh dimension: ``S(0) <- S(0), R`` (rows of A),
``S(1) <- R, S(1)`` (columns of B), ``P(sum) <- S(1), S(0)`` (the contracted
dimension split: each rank holds a partial product), ``P <- P, R`` and
``P <- R, P`` (the product is linear in each factor), ``R <- R, R``. ``bmm``
adds the batch dimension; ``addmm`` adds the bias, laid out like the output.
``embedding``: a column-sharded table gives column-sharded rows, sharded
indices give sharded rows; a row-sharded table is replicated first (PyTorch
instead masks lookups into a Partial).
"""

from __future__ import annotations

import torch

from .._placements import Partial, Placement, Replicate, Shard
from ._registry import DimRule, OpCall, Plan, choose, register

aten = torch.ops.aten

__all__: list[str] = []

R = Replicate()
P = Partial()


def _mm_candidates() -> list[DimRule]:
    return [DimRule((Shard(0),), (Shard(0), R)), DimRule((Shard(1),), (R, Shard(1))),
            DimRule((P,), (Shard(1), Shard(0))), DimRule((P,), (P, R)), DimRule((P,), (R, P)),
            DimRule((R,), (R, R))]


@register(aten.mm.default)
def mm_rule(call: OpCall) -> Plan:
    ins, outs = choose(call, call.specs, _mm_candidates())
    return Plan(ins, outs, {"shapes": [(call.specs[0].shape[0], call.specs[1].shape[1])]})


def _bias_placement(out: Placement, bias_shape: torch.Size, out_ndim: int) -> Placement:
    """The bias's placement that matches output placement ``out`` under broadcasting."""
    if isinstance(out, Shard):
        dim = out.dim - (out_ndim - len(bias_shape))
        return Shard(dim) if dim >= 0 and bias_shape[dim] != 1 else R
    return out


@register(aten.addmm.default)
def addmm_rule(call: OpCall) -> Plan:
    bias, *_ = call.specs
    shapes = {"shapes": [(call.specs[-2].shape[0], call.specs[-1].shape[1])]}
    if len(call.specs) != 3:  # a plain scalar bias: only the matrices are DTensors
        ins, outs = choose(call, call.specs, _mm_candidates())
        return Plan(ins, outs, shapes)
    candidates = [DimRule(c.outs, (_bias_placement(c.outs[0], bias.shape, 2), *c.ins)) for c in _mm_candidates()]
    ins, outs = choose(call, call.specs, candidates)
    return Plan(ins, outs, shapes)


@register(aten.bmm.default)
def bmm_rule(call: OpCall) -> Plan:
    candidates = [DimRule((Shard(0),), (Shard(0), Shard(0))), DimRule((Shard(1),), (Shard(1), R)),
                  DimRule((Shard(2),), (R, Shard(2))), DimRule((P,), (Shard(2), Shard(1))),
                  DimRule((P,), (P, R)), DimRule((P,), (R, P)), DimRule((R,), (R, R))]
    ins, outs = choose(call, call.specs, candidates)
    a, b = call.specs[0].shape, call.specs[1].shape
    return Plan(ins, outs, {"shapes": [(a[0], a[1], b[2])]})


@register(aten.embedding.default)
def embedding_rule(call: OpCall) -> Plan:
    weight, indices = call.specs[0], call.specs[1]
    out_ndim = indices.ndim + 1
    candidates = [DimRule((Shard(out_ndim - 1),), (Shard(1), R))]
    candidates += [DimRule((Shard(d),), (R, Shard(d))) for d in range(indices.ndim)]
    candidates.append(DimRule((R,), (R, R)))
    ins, outs = choose(call, [weight, indices], candidates)
    return Plan(ins, outs, {"shapes": [(*indices.shape, weight.shape[1])]})


@register(aten.embedding_dense_backward.default)
def embedding_backward_rule(call: OpCall) -> Plan:
    grad, indices = call.specs[0], call.specs[1]
    candidates = [DimRule((Shard(1),), (Shard(grad.ndim - 1), R))]
    candidates += [DimRule((P,), (Shard(d), Shard(d))) for d in range(indices.ndim)]
    candidates += [DimRule((P,), (P, R)), DimRule((R,), (R, R))]  # linear in the gradient
    ins, outs = choose(call, [grad, indices], candidates)
    return Plan(ins, outs, {"shapes": [(call.arg(2, "num_weights"), grad.shape[-1])]})
