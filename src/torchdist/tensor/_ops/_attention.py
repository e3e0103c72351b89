"""Scaled dot-product attention (PyTorch's CPU flash kernel and its backward): batch and heads may stay sharded.

Query, key and value are ``[batch, heads, length, dim]``; attention mixes positions within one (batch, head)
pair only, so Shard(0) or Shard(1) on all three runs locally, as tensor-parallel attention (heads split) needs.
With a DTensor attention mask everything is replicated.
"""

from __future__ import annotations

import torch

from .._placements import Replicate, Shard
from ._registry import DimRule, OpCall, Plan, choose, register

aten = torch.ops.aten

__all__: list[str] = []

R = Replicate()


def _candidates(num_inputs: int, num_outputs: int, shardable: bool) -> list[DimRule]:
    rules = [DimRule((Shard(d),) * num_outputs, (Shard(d),) * num_inputs) for d in (0, 1)] if shardable else []
    return rules + [DimRule((R,) * num_outputs, (R,) * num_inputs)]


@register(aten._scaled_dot_product_flash_attention_for_cpu.default)
def sdpa_rule(call: OpCall) -> Plan:
    q, v = call.specs[0], call.specs[2]
    plain = call.kwargs.get("attn_mask") is None or len(call.specs) == 3
    ins, outs = choose(call, call.specs, _candidates(len(call.specs), 2, plain and len(call.specs) == 3))
    shapes = [torch.Size([*q.shape[:3], v.shape[3]]), q.shape[:3]]
    return Plan(ins, outs, {"shapes": shapes})


@register(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def sdpa_backward_rule(call: OpCall) -> Plan:
    plain = len(call.specs) == 6
    ins, outs = choose(call, call.specs, _candidates(len(call.specs), 3, plain))
    return Plan(ins, outs, {"shapes": [call.specs[1].shape, call.specs[2].shape, call.specs[3].shape]})
