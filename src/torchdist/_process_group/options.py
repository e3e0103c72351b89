"""The ``*Options`` objects that ``ProcessGroup``'s op methods take: PyTorch's names, fields and defaults.

``pg.allreduce([t], opts)`` is PyTorch's low-level form of ``all_reduce``: ``opts``
carries what the c10d functions take as arguments. As PyTorch's (pybind11 objects),
these are built without arguments and filled field by field; a field refuses a value
of the wrong type (``TypeError``) and an options object takes no fields but its own
(``AttributeError``). Defaults::

    asyncOp    True          the op runs beside the caller, who waits on its Work
    timeout    -1 ms         unset: the group's timeout applies
    reduceOp   ReduceOp.SUM
    rootRank   0             a *group* rank
    rootTensor 0             which tensor of the root's list is sent
    device_ids []            (BarrierOptions; no accelerators here)
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

import torch

from .reduce_op import RedOpType, ReduceOp

__all__ = ["AllgatherOptions", "AllreduceCoalescedOptions", "AllreduceOptions", "AllToAllOptions", "BarrierOptions",
           "BroadcastOptions", "GatherOptions", "ReduceOptions", "ReduceScatterOptions", "ScatterOptions",
           "UNSET_TIMEOUT"]

#: PyTorch's ``kUnsetTimeout``: an op with it uses its group's timeout.
UNSET_TIMEOUT = timedelta(milliseconds=-1)


def _int(value: Any) -> int:
    if not isinstance(value, int):
        raise TypeError("int")
    return int(value)


def _bool(value: Any) -> bool:
    if not isinstance(value, (bool, int)):
        raise TypeError("bool")
    return bool(value)


def _timedelta(value: Any) -> timedelta:
    if not isinstance(value, timedelta):
        raise TypeError("datetime.timedelta")
    return value


def _reduce_op(value: Any) -> ReduceOp:
    if not isinstance(value, ReduceOp):  # ReduceOp, or one of its members (RedOpType)
        raise TypeError("torchdist.ReduceOp")
    return ReduceOp(value) if isinstance(value, RedOpType) else value  # PyTorch converts a member to a ReduceOp


def _int_list(value: Any) -> list[int]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__") or isinstance(value, torch.Tensor):
        raise TypeError("list[int]")
    return [_int(v) for v in value]


def _device(value: Any) -> torch.device | None:
    if value is None:
        return None
    if not isinstance(value, (torch.device, str)):
        raise TypeError("torch.device")
    return torch.device(value)


class _Field:
    """One typed field: reading gives the stored value, writing converts it or raises
    ``TypeError`` as PyTorch's property setters do."""

    def __init__(self, convert: Callable[[Any], Any], default: Callable[[], Any]) -> None:
        self._convert = convert
        self._default = default

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name
        self._slot = "_" + name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        try:
            value = getattr(obj, self._slot)
        except AttributeError:  # never set
            value = self._default()
        # PyTorch's getter converts from C++ each time: a list read is a copy, so appending to it changes nothing
        return list(value) if isinstance(value, list) else value

    def __set__(self, obj: Any, value: Any) -> None:
        try:
            value = self._convert(value)
        except TypeError as exc:
            raise TypeError(f"{type(obj).__name__}.{self._name}: incompatible function arguments: expected "
                            f"{exc}, got {type(value).__name__} {value!r}") from None
        setattr(obj, self._slot, value)


def _async() -> _Field:
    return _Field(_bool, lambda: True)


def _timeout() -> _Field:
    return _Field(_timedelta, lambda: UNSET_TIMEOUT)


def _root() -> _Field:
    return _Field(_int, lambda: 0)


def _op() -> _Field:
    return _Field(_reduce_op, lambda: ReduceOp(RedOpType.SUM))


class _Options:
    """Base: no constructor arguments, no fields beyond the class's own; every op has a timeout and asyncOp."""

    __slots__ = ("_timeout", "_asyncOp")
    timeout = _timeout()
    asyncOp = _async()

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._fields())
        return f"{type(self).__name__}({fields})"

    @classmethod
    def _fields(cls) -> list[str]:
        return [name for klass in reversed(cls.__mro__) for name, v in vars(klass).items() if isinstance(v, _Field)]


class AllreduceOptions(_Options):
    __slots__ = ("_reduceOp",)
    reduceOp = _op()


class AllreduceCoalescedOptions(_Options):
    __slots__ = ("_reduceOp",)
    reduceOp = _op()


class ReduceOptions(_Options):
    __slots__ = ("_reduceOp", "_rootRank", "_rootTensor")
    reduceOp = _op()
    rootRank = _root()
    rootTensor = _root()


class BroadcastOptions(_Options):
    __slots__ = ("_rootRank", "_rootTensor")
    rootRank = _root()
    rootTensor = _root()


class AllgatherOptions(_Options):
    __slots__ = ()


class GatherOptions(_Options):
    __slots__ = ("_rootRank",)
    rootRank = _root()


class ScatterOptions(_Options):
    __slots__ = ("_rootRank",)
    rootRank = _root()


class ReduceScatterOptions(_Options):
    __slots__ = ("_reduceOp",)
    reduceOp = _op()


class AllToAllOptions(_Options):
    __slots__ = ()


class BarrierOptions(_Options):
    __slots__ = ("_device_ids", "_device")
    device_ids = _Field(_int_list, list)
    device = _Field(_device, lambda: None)
