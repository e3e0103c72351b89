"""``register_sharding``: a user's sharding strategies for an aten op, used by the dispatcher before any rule.

The user's function takes the op's arguments (each DTensor replaced by its ``DTensorSpec``: ``shape``,
``ndim``, ``placements``, ``mesh``) and returns the acceptable ``(output placements, input placements)`` pairs
for ONE mesh dimension (``None`` for a non-tensor argument or output). As in PyTorch, the pairs are expanded
to every combination over the mesh dimensions (the first mesh dim varies slowest), and combinations are dropped
that mix Partial kinds, shard an input dim with fewer rows than shards (or past its last dim), or, for in-place
ops, would move self. The pick follows PyTorch's ``_select_min_cost_strategy``: the last combination that moves
no input, else the first one that moves inputs for free (a replicated input, or Replicate -> Shard/Partial),
else the cheapest (first on ties), costs from the alpha-beta model of ``_ops._registry``.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

import torch

from .._api import DTensor
from .._ops._registry import CUSTOM_RULES, OpCall, Plan, redistribute_cost
from .._placements import Partial, Placement, Replicate, Shard

__all__ = ["register_sharding"]

PlacementList = Sequence[Placement | None]
ShardingFn = Callable[..., Sequence[tuple[PlacementList, PlacementList]]]


def register_sharding(op: torch._ops.OpOverload | list[torch._ops.OpOverload]) -> Callable[[ShardingFn], ShardingFn]:
    """Decorator: ``fn(*args, **kwargs) -> [(output placements, input placements), ...]`` decides the sharding
    of ``op`` (an OpOverload or a list of them), overriding torchdist's rule for it. Returns ``fn`` unchanged."""
    overloads = op if isinstance(op, list) else [op]
    for overload in overloads:
        if not isinstance(overload, torch._ops.OpOverload):
            raise TypeError(f"register_sharding expects an OpOverload (e.g. aten._softmax.default) or a list of them, "
                            f"got {overload!r}")

    def wrapper(custom_sharding_fn: ShardingFn) -> ShardingFn:
        for overload in overloads:
            CUSTOM_RULES[overload] = _custom_rule(custom_sharding_fn)
        return custom_sharding_fn
    return wrapper


def _custom_rule(custom_sharding_fn: ShardingFn) -> Callable[[OpCall], Plan]:
    """The dispatcher's rule for a user's function: ask it on this call's specs, then expand and pick."""
    def rule(call: OpCall) -> Plan:
        args = tuple(_to_spec(a) for a in call.args)
        kwargs = {k: _to_spec(v) for k, v in call.kwargs.items()}
        num_outputs = len(call.func._schema.returns)
        single_dim = [list(outs) + list(ins) for outs, ins in custom_sharding_fn(*args, **kwargs)]
        return _choose(call, single_dim, num_outputs)
    return rule


def _to_spec(arg: Any) -> Any:
    """What the user's function sees for an argument: a DTensor's spec, a tuple of specs for a list of DTensors."""
    if isinstance(arg, DTensor):
        return arg._spec
    if isinstance(arg, (list, tuple)) and any(isinstance(a, DTensor) for a in arg):
        return tuple(_to_spec(a) for a in arg)
    return arg


def _choose(call: OpCall, single_dim: list[list], num_outputs: int) -> Plan:
    """PyTorch's expansion over the mesh and its selection among the valid combinations."""
    mesh = call.mesh
    valid: list[tuple[list[tuple], list[tuple]]] = []  # (placements per output, placements per DTensor input)
    blocked_inplace = False
    for comb in itertools.product(single_dim, repeat=mesh.ndim):
        columns = list(zip(*comb))  # one per output/input position: its placement on each mesh dim
        outs = [tuple(c) for c in columns[:num_outputs] if c[0] is not None]
        ins = [tuple(c) for c in columns[num_outputs:] if c[0] is not None]
        if len(ins) != len(call.specs):
            raise RuntimeError(_count_mismatch(call, len(ins)))
        if any(_mixes_partials(p) for p in outs + ins):
            continue
        self_out = tuple(columns[0]) if num_outputs and columns[0][0] is not None else None
        if call.inplace and (ins[0] != call.specs[0].placements or self_out not in (None, call.specs[0].placements)):
            blocked_inplace = True
            continue
        if not all(_shardable(spec.shape, p, mesh) for spec, p in zip(call.specs, ins)):
            continue
        valid.append((outs, ins))
    if not valid:
        if blocked_inplace:
            raise RuntimeError(f"{call.func}: in-place operations that require placement changes are not supported. "
                               f"The input has placement {call.specs[0].placements}, but no valid strategy preserves "
                               "this placement. Please use the out-of-place version of this operation instead.")
        raise RuntimeError(f"{call.func}: none of the strategies of its registered sharding function fits inputs with "
                           f"placements {[s.placements for s in call.specs]} and shapes "
                           f"{[tuple(s.shape) for s in call.specs]} on a mesh of shape {tuple(mesh.shape)}")
    outs, ins = valid[_select(call, [ins for _, ins in valid])]
    return Plan(ins, outs)


def _count_mismatch(call: OpCall, given: int) -> str:
    """PyTorch's message for a strategy with more or fewer tensor inputs than the call has, and what to do."""
    in_args = sum(isinstance(a, DTensor) for a in call.args)
    in_kwargs = sum(isinstance(v, DTensor) for v in call.kwargs.values())
    return (f"input_specs({given}) != strategies({in_args + in_kwargs}: {in_args} args + {in_kwargs} kwargs)\n"
            f"The sharding function registered for {call.func} must give one placement for each tensor argument "
            "(None for the others), after the output placements")


def _mixes_partials(placements: tuple) -> bool:
    """Two Partial kinds in one spec (sum with avg excepted, as they commute)."""
    ops = {p.reduce_op for p in placements if isinstance(p, Partial)}
    return len(ops) > 1 and ops != {"sum", "avg"}


def _shardable(shape: Sequence[int], placements: tuple, mesh) -> bool:
    """Every sharded dim exists and has at least as many rows as shards (PyTorch's is_tensor_shardable)."""
    shards = [1] * len(shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            if p.dim >= len(shape):
                return False
            shards[p.dim] *= mesh.size(mesh_dim)
            if shape[p.dim] < shards[p.dim]:
                return False
    return True


def _select(call: OpCall, candidates: list[list[tuple]]) -> int:
    """Index of the chosen combination: the last that moves nothing, else the first free one, else the cheapest."""
    costs = [sum(_spec_cost(spec, want, call.mesh) for spec, want in zip(call.specs, ins)) for ins in candidates]
    if len(candidates) == 1:
        return 0
    unmoved = [i for i, ins in enumerate(candidates)
               if costs[i] == 0 and all(s.placements == want for s, want in zip(call.specs, ins))]
    if unmoved:
        return unmoved[-1]
    free = [i for i, cost in enumerate(costs) if cost == 0]
    if free:
        return free[0]
    return costs.index(min(costs))


def _spec_cost(spec, target: tuple, mesh) -> float:
    """PyTorch's cost of moving one input to ``target``: nothing from a replicated input, else its greedy plan's
    steps, each priced on the bytes a rank holds at that point (a free local chunk first makes a gather cheaper)."""
    if spec.is_replicated() or spec.placements == target:
        return 0.0
    nbytes = spec.shape.numel() * spec.tensor_meta.dtype.itemsize / spec.num_shards
    total = 0.0
    for mesh_dim, source, want in _greedy_steps(spec.placements, target, spec.num_shards):
        world = mesh.size(mesh_dim)
        if isinstance(source, Replicate):  # a local chunk or scaling: free; a chunk shrinks what later steps move
            nbytes /= world if isinstance(want, Shard) else 1
            continue
        total += redistribute_cost(source, want, nbytes, world)
        if isinstance(source, Shard) and isinstance(want, Replicate):
            nbytes *= world
        elif isinstance(source, Partial) and isinstance(want, Shard):
            nbytes /= world
    return total


def _greedy_steps(current: tuple, target: tuple, num_shards: int) -> list[tuple[int, Placement, Placement]]:
    """The (mesh dim, from, to) steps of PyTorch's greedy redistribution plan: last mesh dim to first (a shard
    whose nesting under earlier mesh dims would change goes through Replicate), then first to last for the rest."""
    current, steps = list(current), []
    if len(current) > 1 and num_shards > 1:
        for mesh_dim in reversed(range(len(current))):
            want = target[mesh_dim]
            if isinstance(want, Shard):
                before_now = [i for i in range(mesh_dim) if current[i].is_shard(want.dim)]
                before_then = [i for i in range(mesh_dim) if target[i].is_shard(want.dim)]
                want = want if before_now == before_then else Replicate()
            if current[mesh_dim] != want:
                steps.append((mesh_dim, current[mesh_dim], want))
                current[mesh_dim] = want
    for mesh_dim, want in enumerate(target):
        if current[mesh_dim] != want:
            steps.append((mesh_dim, current[mesh_dim], want))
            current[mesh_dim] = want
    return steps
