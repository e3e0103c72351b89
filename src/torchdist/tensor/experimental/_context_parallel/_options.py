"""The process-wide options of context parallelism, as PyTorch keeps them: one mutable ``_cp_options``.

Users switch load balancing off with ``_cp_options.enable_load_balance = False`` and choose how K/V travel with
:func:`set_rotate_method`; ``context_parallel`` sets ``enable_load_balance`` to whether the buffers it sharded were
actually balanced for the time of the context, and puts the user's value back on exit.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto


class _RotateMethod(Enum):
    """How the ring moves K/V: ``ALL_TO_ALL`` passes blocks to the neighbour, ``ALL_GATHER`` gathers them once."""

    ALL_TO_ALL = auto()
    ALL_GATHER = auto()


@dataclass
class _ContextParallelOptions:
    """``convert_to_f32``: accumulate blocks in float32; ``enable_load_balance``: head-tail sharding of the sequence
    (when its length is divisible by 2 x the context-parallel size); ``rotate_method``: see :class:`_RotateMethod`."""

    convert_to_f32: bool = True
    enable_load_balance: bool = True
    rotate_method: _RotateMethod = _RotateMethod.ALL_GATHER


_cp_options = _ContextParallelOptions()


def set_rotate_method(rotate_method: str) -> None:
    """Choose how K/V shards are rotated: ``"allgather"`` (the default) or ``"alltoall"`` (neighbour passing)."""
    if rotate_method == "allgather":
        _cp_options.rotate_method = _RotateMethod.ALL_GATHER
    elif rotate_method == "alltoall":
        _cp_options.rotate_method = _RotateMethod.ALL_TO_ALL
    else:
        raise NotImplementedError(f"Context Parallel does not support using {rotate_method} for kv shards rotation")
