"""Which standard streams a setting applies to (``Std``), per local rank (``to_map``)."""

from __future__ import annotations

import enum
from typing import Mapping

__all__ = ["Std", "to_map"]


class Std(enum.IntFlag):
    """Which standard streams a setting applies to: ``0`` none, ``1`` out, ``2`` err, ``3`` both."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3

    @classmethod
    def from_str(cls, value: str) -> "Std | dict[int, Std]":
        """``"3"`` -> ``Std.ALL``; ``"0:1,1:2"`` -> ``{0: Std.OUT, 1: Std.ERR}`` (per local rank)."""
        value = value.strip()
        try:
            if ":" not in value:
                return cls._one(value)
            pairs = (item.split(":") for item in value.split(","))
            return {int(rank): cls._one(std) for rank, std in pairs}
        except ValueError:
            raise ValueError(
                f"{value!r} is not a valid stream setting: use 0 (none), 1 (stdout), 2 (stderr), 3 (both), "
                "or per local rank as 'local_rank:value,...' (e.g. '0:3,1:0')"
            ) from None

    @classmethod
    def _one(cls, text: str) -> "Std":
        number = int(text)
        if not 0 <= number <= 3:
            raise ValueError(text)
        return cls(number)


def to_map(val_or_map: Std | Mapping[int, Std], local_world_size: int) -> dict[int, Std]:
    """One :class:`Std` per local rank; ranks a mapping leaves out get ``Std.NONE``."""
    if isinstance(val_or_map, Std):
        return dict.fromkeys(range(local_world_size), val_or_map)
    return {rank: Std(val_or_map.get(rank, Std.NONE)) for rank in range(local_world_size)}
