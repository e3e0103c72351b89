"""Sharding rules of aten ops, one module per family; importing this package registers them all."""

from . import _attention, _math, _matrix, _pointwise, _tensor_ops, _view
from ._registry import RULES, OpCall, Plan

_REGISTERED = (_attention, _math, _matrix, _pointwise, _tensor_ops, _view)  # imported for their registrations

__all__ = ["RULES", "OpCall", "Plan"]
