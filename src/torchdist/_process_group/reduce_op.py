"""``ReduceOp``: how a reduction combines the ranks' values, with PyTorch's API.

``ReduceOp.SUM`` and friends are members of the ``ReduceOp.RedOpType`` enum, and
``isinstance(ReduceOp.SUM, ReduceOp)`` holds, as in PyTorch. A ``ReduceOp`` instance
wraps one member, or a PREMUL_SUM with its ``factor`` (made by
``_make_nccl_premul_sum``): each rank's input is multiplied by the factor, then summed.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["ReduceOp", "RedOpType", "reduce_op", "_make_nccl_premul_sum", "supports_complex", "COMPLEX_REDUCE_OPS"]


class RedOpType(enum.IntEnum):
    SUM = 0
    AVG = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4
    BAND = 5
    BOR = 6
    BXOR = 7
    PREMUL_SUM = 8
    UNUSED = 9

    # str() and f-strings show the name, as PyTorch's enum does ("RedOpType.SUM"), not the int
    __str__ = enum.Enum.__str__
    __format__ = enum.Enum.__format__


class _ReduceOpMeta(type):
    # PyTorch's members are RedOpType values yet count as ReduceOp instances.
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, RedOpType) or type.__instancecheck__(cls, obj)


class ReduceOp(metaclass=_ReduceOpMeta):
    """A reduction: ``ReduceOp.SUM``, ``ReduceOp(ReduceOp.MAX)``, or a PREMUL_SUM."""

    RedOpType = RedOpType
    SUM = RedOpType.SUM
    AVG = RedOpType.AVG
    PRODUCT = RedOpType.PRODUCT
    MIN = RedOpType.MIN
    MAX = RedOpType.MAX
    BAND = RedOpType.BAND
    BOR = RedOpType.BOR
    BXOR = RedOpType.BXOR
    PREMUL_SUM = RedOpType.PREMUL_SUM
    UNUSED = RedOpType.UNUSED

    def __init__(self, op: "RedOpType | ReduceOp | int" = RedOpType.SUM, factor: float | None = None) -> None:
        if type.__instancecheck__(ReduceOp, op):
            op, factor = op.op, op.factor if factor is None else factor
        try:
            self.op = RedOpType(op)
        except ValueError:
            raise ValueError(f"invalid ReduceOp {op!r}; use one of {[m.name for m in RedOpType]}") from None
        self.factor = factor

    def __eq__(self, other: object) -> bool:
        if type.__instancecheck__(ReduceOp, other):
            return self.op == other.op and self.factor == other.factor
        if isinstance(other, RedOpType):
            return self.op == other and self.factor is None
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.op, self.factor))

    def __repr__(self) -> str:
        suffix = f"({self.factor})" if self.factor is not None else ""
        return f"ReduceOp.{self.op.name}{suffix}"


def as_red_op(op: "ReduceOp | RedOpType | int") -> tuple[RedOpType, float | None]:
    """Normalize any accepted spelling of an op to (kind, premul factor)."""
    if type.__instancecheck__(ReduceOp, op):
        return op.op, op.factor
    if isinstance(op, RedOpType):  # not a plain int: PyTorch's binding refuses those too
        return op, None
    raise TypeError(f"op must be a torchdist.ReduceOp, got {type(op).__name__}")


def _make_nccl_premul_sum(factor: float) -> ReduceOp:
    """A SUM that first multiplies each rank's input by ``factor`` (e.g. 1/world_size)."""
    return ReduceOp(RedOpType.PREMUL_SUM, factor)


#: The reduce ops defined on complex tensors.
COMPLEX_REDUCE_OPS = frozenset({RedOpType.SUM, RedOpType.AVG, RedOpType.PREMUL_SUM})


def supports_complex(op: "ReduceOp | RedOpType") -> bool:
    """Only SUM, AVG and PREMUL_SUM are defined on complex tensors."""
    return as_red_op(op)[0] in COMPLEX_REDUCE_OPS


class reduce_op:  # noqa: N801 - PyTorch's deprecated alias keeps its name
    """Deprecated alias of ReduceOp's members, kept so old scripts run."""

    SUM = RedOpType.SUM
    PRODUCT = RedOpType.PRODUCT
    MIN = RedOpType.MIN
    MAX = RedOpType.MAX
