"""The rule table and the one-mesh-dimension strategy chooser that every rule uses.

A rule looks at an op call (the specs of its DTensor arguments, the other
arguments) and returns a :class:`Plan`: the placements each DTensor argument
must have when the op runs on the local blocks, and the placements of each
tensor the op returns. Most rules list *candidates for one mesh dimension*
(``DimRule``: output placements + input placements, e.g. for ``mm``:
``S(0) <- S(0), R``, ``S(1) <- R, S(1)``, ``P <- S(1), S(0)``, ``R <- R, R``)
and :func:`choose` picks, independently on each mesh dimension, the candidate
whose redistribution of the inputs costs least (ties: the first listed), as
PyTorch's single-dim strategies do. Shards of one tensor dimension on several
mesh dimensions nest consistently on inputs and outputs, so per-dimension
choices compose.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .._placements import Partial, Placement, Replicate, Shard
from .._spec import DTensorSpec

__all__ = ["RULES", "CUSTOM_RULES", "register", "OpCall", "Plan", "DimRule", "choose", "redistribute_cost"]


@dataclass
class OpCall:
    """An aten op call as the rules see it: the op, its arguments, and where the DTensors are."""

    func: Any
    args: tuple
    kwargs: dict
    specs: list[DTensorSpec]                    # of the DTensor arguments, in flattened argument order
    mesh: Any

    @property
    def inplace(self) -> bool:
        """Whether the op writes into its first argument (``add_``, ``copy_``, ``_foreach_mul_``...)."""
        arguments = self.func._schema.arguments
        return bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        if len(self.args) > index:
            return self.args[index]
        return self.kwargs.get(name, default)


@dataclass
class Plan:
    """What a rule decided: placements of each DTensor input when the op runs, and of each tensor output."""

    inputs: list[tuple[Placement, ...]]
    outputs: list[tuple[Placement, ...]]
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class DimRule:
    """One candidate on one mesh dimension: ``outs`` (per output) when the inputs have ``ins`` (per DTensor input)."""

    outs: tuple[Placement, ...]
    ins: tuple[Placement, ...]


RULES: dict[Any, Callable[[OpCall], Plan]] = {}
#: Rules from ``experimental.register_sharding`` (per OpOverload): the dispatcher asks them before RULES and the
#: specially answered ops, and registering never touches RULES, so a built-in rule stays for other ops.
CUSTOM_RULES: dict[Any, Callable[[OpCall], Plan]] = {}


def register(*ops: Any) -> Callable:
    """Decorator: ``fn(call) -> Plan`` is the rule of every op (overload or packet: all its overloads) in ``ops``."""
    def wrap(fn: Callable[[OpCall], Plan]) -> Callable[[OpCall], Plan]:
        for op in ops:
            if isinstance(op, torch._ops.OpOverloadPacket):
                for name in op.overloads():
                    RULES[getattr(op, name)] = fn
            else:
                RULES[op] = fn
        return fn
    return wrap


_TINY = 1e-3  # tie-breakers: local moves cost no communication, but keeping a layout beats changing it

# An alpha-beta model in microseconds (the figures PyTorch's estimator uses for one host): every collective pays
# a base latency plus a per-hop latency, and its bytes at the link bandwidth.
_BASE_LATENCY_US = 6.6
_HOP_LATENCY_US = 0.6
_BANDWIDTH_GBPS = 87.7
_IMPOSSIBLE = 1e12


def _collective_us(nbytes: float, world: int, hops: int) -> float:
    return _BASE_LATENCY_US + hops * _HOP_LATENCY_US + (nbytes / 2**30) * hops / world / _BANDWIDTH_GBPS * 1e6


def redistribute_cost(source: Placement, target: Placement, local_bytes: float, world: int) -> float:
    """Estimated time (us) to change one mesh dimension from ``source`` to ``target``; ``local_bytes``: the block.

    Shard -> Shard is priced as an all-gather plus a penalty (PyTorch's choice: it prefers gathering), a change
    into Partial from anything but Replicate is impossible, and local moves cost only a tie-breaker.
    """
    if source == target:
        return 0.0
    if isinstance(source, Replicate):  # take a chunk, or scale: no communication; staying replicated wins ties
        return _TINY * (2 if isinstance(target, Partial) else 0.5)
    if isinstance(source, Shard):
        if isinstance(target, Replicate):
            return _collective_us(local_bytes * world, world, world - 1) + _TINY
        if isinstance(target, Shard):
            return _collective_us(local_bytes, world, world - 1) + 1.0
        return _IMPOSSIBLE
    if isinstance(target, Replicate):
        return _collective_us(local_bytes, world, 2 * (world - 1)) + _TINY
    if isinstance(target, Shard):
        return _collective_us(local_bytes, world, world - 1) + _TINY
    return _IMPOSSIBLE


def _local_bytes(spec: DTensorSpec) -> float:
    return spec.shape.numel() * spec.tensor_meta.dtype.itemsize / spec.num_shards


def choose(call: OpCall, inputs: Sequence[DTensorSpec], candidates: Sequence[DimRule],
           fixed: int | None = None) -> tuple[list[tuple[Placement, ...]], list[tuple[Placement, ...]]]:
    """Per mesh dimension, the cheapest candidate (ties: the first); ``fixed``: an in-place op's self, its output.

    Returns (placements of each input, placements of each output).
    """
    mesh = call.mesh
    num_outputs = len(candidates[0].outs) if candidates else 0
    if all(spec.is_replicated() for spec in inputs):
        # Replicated inputs stay replicated (PyTorch's fast path), rather than being cut up for free.
        replicated = [c for c in candidates if all(isinstance(p, Replicate) for p in c.ins)]
        candidates = replicated or candidates
    ins: list[list[Placement]] = [[] for _ in inputs]
    outs: list[list[Placement]] = [[] for _ in range(num_outputs)]
    for mesh_dim in range(mesh.ndim):
        world = mesh.size(mesh_dim)
        best, best_cost = None, None
        usable = candidates
        if fixed is not None:
            # An in-place op's self is its output; it keeps its placement unless no candidate allows that.
            usable = [c for c in candidates if c.ins[fixed] == c.outs[0] == inputs[fixed].placements[mesh_dim]] \
                or [c for c in candidates if c.ins[fixed] == c.outs[0]]
        for cand in usable:
            cost = sum(redistribute_cost(spec.placements[mesh_dim], want, _local_bytes(spec), world)
                       for spec, want in zip(inputs, cand.ins))
            if best_cost is None or cost < best_cost:
                best, best_cost = cand, cost
        if best is None:
            raise RuntimeError(
                f"{call.func}: the in-place op cannot keep its self argument's placement "
                f"{inputs[fixed].placements[mesh_dim]} on mesh dimension {mesh_dim} (rank "
                f"{mesh.get_rank()}); redistribute the DTensor first, e.g. to Replicate, or use the out-of-place op")
        for k, placement in enumerate(best.ins):
            ins[k].append(placement)
        for k, placement in enumerate(best.outs):
            outs[k].append(placement)
    return [tuple(p) for p in ins], [tuple(p) for p in outs]


def replicate_all(call: OpCall, num_outputs: int) -> Plan:
    """Everything replicated: the plan of ops with no better rule."""
    rep = tuple(Replicate() for _ in range(call.mesh.ndim))
    return Plan([rep] * len(call.specs), [rep] * num_outputs)
