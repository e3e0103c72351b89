"""``ReduceOp``: how a reduction combines the ranks' values, with PyTorch's API.

``ReduceOp.SUM`` and friends are members of the ``ReduceOp.RedOpType`` enum, and
``isinstance(ReduceOp.SUM, ReduceOp)`` holds, as in PyTorch. A ``ReduceOp`` instance
wraps one member, or a PREMUL_SUM with its ``factor`` (made by
``_make_nccl_premul_sum``): each rank's input is multiplied by the factor, then summed.
"""

from __future__ import annotations

import enum
import warnings
from typing import Any

__all__ = ["ReduceOp", "RedOpType", "reduce_op", "_make_nccl_premul_sum", "supports_complex", "COMPLEX_REDUCE_OPS",
           "reduction_key"]


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

    def __call__(self, factor: Any) -> "ReduceOp":
        """``ReduceOp.PREMUL_SUM(factor)``: PyTorch's other spelling of ``_make_nccl_premul_sum``."""
        if self is not RedOpType.PREMUL_SUM:
            raise RuntimeError(f"Only PREMUL_SUM supports calling with a factor, got {self}")
        return _make_nccl_premul_sum(factor)


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

    def __init__(self, op: RedOpType) -> None:
        """``op``: a member (``ReduceOp.MAX``); as in PyTorch, nothing else is accepted."""
        if not isinstance(op, RedOpType):
            raise TypeError(f"ReduceOp.__init__(): incompatible constructor arguments: expected a "
                            f"ReduceOp.RedOpType member such as ReduceOp.SUM, got {op!r}")
        if op is RedOpType.PREMUL_SUM:
            raise RuntimeError("ReduceOp(PREMUL_SUM) needs a factor: use torchdist._make_nccl_premul_sum(factor) "
                               "or ReduceOp.PREMUL_SUM(factor) to create an instance of ReduceOp with PREMUL_SUM")
        self.op = op
        self.factor: Any = None

    # Equality and hash look at the kind only, as PyTorch's: two PREMUL_SUMs are equal
    # whatever their factors, and ReduceOp(SUM) hashes as SUM.
    def __eq__(self, other: object) -> bool:
        if type.__instancecheck__(ReduceOp, other):
            return self.op == other.op
        if isinstance(other, RedOpType):
            return self.op == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.op)

    def __repr__(self) -> str:
        suffix = f"({self.factor})" if self.factor is not None else ""
        return f"ReduceOp.{self.op.name}{suffix}"


def as_red_op(op: "ReduceOp | RedOpType | int") -> tuple[RedOpType, float | None]:
    """Normalize any accepted spelling of an op to (kind, premul factor)."""
    if type.__instancecheck__(ReduceOp, op):
        kind, factor = op.op, op.factor
    elif isinstance(op, RedOpType):  # not a plain int: PyTorch's binding refuses those too
        kind, factor = op, None
    else:
        raise TypeError(f"op must be a torchdist.ReduceOp, got {type(op).__name__}")
    if kind is RedOpType.PREMUL_SUM and factor is None:  # PyTorch's binding refuses it (TypeError)
        raise TypeError("ReduceOp.PREMUL_SUM needs its factor: pass torchdist._make_nccl_premul_sum(factor)")
    return kind, factor


def reduction_key(op: "ReduceOp | RedOpType") -> "RedOpType | tuple":
    """A cache key that tells apart everything that changes a reduction. ``ReduceOp``'s
    own equality does not: as in PyTorch, PREMUL_SUMs are equal whatever their factors.
    A tensor factor is keyed by its value (an id could be reused by a later tensor)."""
    if type(op) is RedOpType:  # the common case, on every small op's path
        return op
    kind, factor = as_red_op(op)
    return kind, factor.item() if hasattr(factor, "item") else factor


def _make_nccl_premul_sum(factor: Any) -> ReduceOp:
    """A SUM that first multiplies each rank's input by ``factor`` (a number or a
    one-element tensor, e.g. 1/world_size)."""
    premul = ReduceOp(RedOpType.SUM)
    premul.op, premul.factor = RedOpType.PREMUL_SUM, factor
    return premul


#: The reduce ops defined on complex tensors.
COMPLEX_REDUCE_OPS = frozenset({RedOpType.SUM, RedOpType.AVG, RedOpType.PREMUL_SUM})


def supports_complex(op: "ReduceOp | RedOpType") -> bool:
    """Only SUM, AVG and PREMUL_SUM are defined on complex tensors."""
    return as_red_op(op)[0] in COMPLEX_REDUCE_OPS


class _DeprecatedReduceOp:
    """``reduce_op``: PyTorch's deprecated alias of ReduceOp's members; each use warns."""

    def __init__(self) -> None:
        for name, member in RedOpType.__members__.items():
            if member is not RedOpType.UNUSED:
                object.__setattr__(self, name, member)

    def __getattribute__(self, name: str) -> Any:
        warnings.warn("`torchdist.reduce_op` is deprecated, please use `torchdist.ReduceOp` instead",
                      FutureWarning, stacklevel=2)
        return object.__getattribute__(self, name)


reduce_op = _DeprecatedReduceOp()
