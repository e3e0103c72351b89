"""Ops that move no data: copies, casts, ``*_like`` factories, ``fill_``/``zero_``/``copy_``, random fills.

``detach``, ``clone``, ``_to_copy``, ``alias`` keep the placements, Partial
included. ``*_like`` factories keep the shards but turn Partial into Replicate
(the new values are not pending a reduction) without moving the input. Random
ops keep the shards and, as PyTorch does on CPU meshes, draw each rank's block
from that rank's own generator (same seed, same block shape: same numbers).
"""

from __future__ import annotations

import warnings

import torch

from .._placements import Partial, Replicate
from ._pointwise import pointwise_rule
from ._registry import OpCall, Plan, register

aten = torch.ops.aten

__all__ = ["RANDOM_OPS"]


@register(aten.detach.default, aten.alias.default, aten.clone.default, aten._to_copy.default,
          aten.lift_fresh.default)
def keep_placements(call: OpCall) -> Plan:
    placements = call.specs[0].placements
    return Plan([placements] + [tuple(Replicate() for _ in placements)] * (len(call.specs) - 1), [placements],
                {"shapes": [call.specs[0].shape]})


def _unpartial(placements):
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


@register(aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default)
def like_rule(call: OpCall) -> Plan:
    placements = call.specs[0].placements
    return Plan([placements], [_unpartial(placements)], {"shapes": [call.specs[0].shape]})


@register(aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
          aten.new_empty_strided.default)
def new_factory_rule(call: OpCall) -> Plan:
    # The size argument is the global size: every rank makes the whole tensor.
    return Plan([call.specs[0].placements], [tuple(Replicate() for _ in range(call.mesh.ndim))])


register(aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default, aten.copy_.default)(pointwise_rule)

_RANDOM_PACKETS = (aten.native_dropout, aten.normal_, aten.rand_like, aten.randn_like, aten.randint_like,
                   aten.uniform_, aten.bernoulli, aten.bernoulli_, aten.exponential_, aten.random_, aten.cauchy_,
                   aten.log_normal_, aten.geometric_)
RANDOM_OPS = {getattr(packet, name) for packet in _RANDOM_PACKETS for name in packet.overloads()
              if "out" not in name}


@register(*RANDOM_OPS)
def random_rule(call: OpCall) -> Plan:
    warnings.warn(f"DTensor random operators may not have complete support on {call.mesh.device_type} device mesh",
                  stacklevel=2)
    placements = call.specs[0].placements
    if call.inplace and any(isinstance(p, Partial) for p in placements):
        raise RuntimeError(f"{call.func} with Partial is not supported yet! (rank {call.mesh.get_rank()}): "
                           "redistribute the DTensor to Replicate or Shard first")
    num_outputs = sum(1 for r in call.func._schema.returns if "Tensor" in str(r.type))
    if call.func in (aten.rand_like.default, aten.randn_like.default) or call.func._schema.name.startswith(
            "aten::randint_like"):
        return Plan([placements], [_unpartial(placements)], {"shapes": [call.specs[0].shape]})
    inputs = _unpartial(placements)
    rest = [tuple(Replicate() for _ in placements)] * (len(call.specs) - 1)
    return Plan([inputs] + rest, [inputs] * num_outputs, {"shapes": [call.specs[0].shape] * num_outputs})
