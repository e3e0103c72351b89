"""The tracer front end: ``pipeline(module, mb_args)`` cuts a model into stage modules at its split points.

The model is traced with ``torch.fx``. Split points are ``pipe_split()`` calls
in its forward, entries of ``split_spec`` (``{"layers.2": SplitPoint.BEGINNING}``
puts a split right before the call of submodule ``layers.2``), or what a
``split_policy`` inserts into the traced graph. Stage k holds the graph nodes
between split k - 1 and split k; its inputs are the values that later nodes
still need (so a value used two stages later passes through the stage in
between: stages only ever talk to their neighbours), and stage 0 keeps the
model's own signature. The stage modules share their parameters with the
model, under the model's names. One run of the stages on the example
microbatch records the shapes every stage sends and receives.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from .._process_group.process_group import ProcessGroup
from ._meta import PipeliningMetadataError
from .stage import PipelineStage, build_stage

__all__ = ["Pipe", "PipeInfo", "SplitPoint", "pipe_split", "pipeline"]


class SplitPoint(Enum):
    """Where ``split_spec`` cuts relative to the named submodule's call."""

    BEGINNING = 1
    END = 2


def _split_marker() -> None:
    """The graph node that stands for a split (``pipe_split`` records it while ``pipeline`` traces)."""
    return None


_tracers: list[fx.Tracer] = []  # the tracer of the ``pipeline`` call in progress, if any


def pipe_split() -> None:
    """Mark a split between two stages in a model's forward (a no-op when the model runs unsplit)."""
    if _tracers:
        _tracers[-1].create_proxy("call_function", _split_marker, (), {})


class _Tracer(fx.Tracer):
    """An fx tracer that inserts ``pipe_split`` calls around the submodules named in a split spec."""

    def __init__(self, split_spec: dict[str, SplitPoint]) -> None:
        super().__init__()
        self.split_spec = split_spec

    def trace(self, root: Any, concrete_args: dict | None = None) -> fx.Graph:
        _tracers.append(self)
        try:
            return super().trace(root, concrete_args)
        finally:
            _tracers.pop()

    def call_module(self, m: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        name = self.path_of_module(m)
        point = self.split_spec.get(name)
        if point is SplitPoint.BEGINNING:
            self.create_proxy("call_function", _split_marker, (), {})
        out = super().call_module(m, forward, args, kwargs)
        if point is SplitPoint.END:
            self.create_proxy("call_function", _split_marker, (), {})
        return out


class PipeInfo:
    """What ``build_stage`` needs about a traced pipeline: the graph, the stage count, example tensors."""

    def __init__(self, graph: fx.Graph, num_stages: int, has_loss_and_backward: bool,
                 stage_examples: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]) -> None:
        self.graph = graph
        self.num_stages = num_stages
        self.has_loss_and_backward = has_loss_and_backward
        self.stage_examples = stage_examples

    def __repr__(self) -> str:
        return f"PipeInfo(num_stages={self.num_stages}, has_loss_and_backward={self.has_loss_and_backward})"


class Pipe(nn.Module):
    """A model cut into stages: ``split_gm.submod_<i>`` is stage i."""

    def __init__(self, split_gm: fx.GraphModule, num_stages: int, info: PipeInfo) -> None:
        super().__init__()
        self.split_gm = split_gm
        self.num_stages = num_stages
        self.has_loss_and_backward = False
        self.pipe_info = info

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the stages one after the other (the unsplit model's result)."""
        out = self.split_gm.submod_0(*args, **kwargs)
        for i in range(1, self.num_stages):
            out = getattr(self.split_gm, f"submod_{i}")(*_as_tuple(out))
        return out

    def get_stage_module(self, stage_idx: int) -> nn.Module:
        if not 0 <= stage_idx < self.num_stages:
            raise ValueError(f"Invalid stage index {stage_idx}! (the pipe has {self.num_stages} stages)")
        return getattr(self.split_gm, f"submod_{stage_idx}")

    def info(self) -> PipeInfo:
        return self.pipe_info

    def build_stage(self, stage_index: int, device: torch.device | str,
                    group: ProcessGroup | None = None) -> PipelineStage:
        """The ``PipelineStage`` of stage ``stage_index`` on this rank."""
        return build_stage(self.get_stage_module(stage_index), stage_index, self.pipe_info, device, group)

    def print_readable(self) -> None:
        self.split_gm.print_readable()


def _as_tuple(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _partition(graph: fx.Graph) -> tuple[dict[fx.Node, int], int]:
    """Each node's stage (splits count up as they appear); pipe_split nodes are removed."""
    stage, where = 0, {}
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is _split_marker:
            graph.erase_node(node)
            stage += 1
        elif node.op != "output":
            where[node] = stage
    return where, stage + 1


def _stage_graphs(gm: fx.GraphModule, where: dict[fx.Node, int], n: int) -> list[fx.Graph]:
    """One graph per stage; the values crossing boundary k are stage k's outputs and stage k+1's inputs."""
    output = next(node for node in gm.graph.nodes if node.op == "output")
    last_use: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        users = [n - 1 if u is output else where[u] for u in node.users]
        if node in where and users:
            last_use[node] = max(users)
    crossing = [[v for v in where if where[v] <= k < last_use.get(v, -1)] for k in range(n - 1)]
    graphs = []
    for k in range(n):
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        if k == 0:
            for node in gm.graph.nodes:
                if node.op == "placeholder":
                    env[node] = graph.node_copy(node, lambda x: env[x])
        else:
            for v in crossing[k - 1]:
                env[v] = graph.placeholder(v.name)
        for node in gm.graph.nodes:
            if where.get(node) == k and node.op != "placeholder":
                env[node] = graph.node_copy(node, lambda x: env[x])
        if k == n - 1:
            graph.output(fx.node.map_arg(output.args[0], lambda x: env[x]))
        else:
            outs = tuple(env[v] for v in crossing[k])
            graph.output(outs[0] if len(outs) == 1 else outs)
        graphs.append(graph)
    return graphs


def pipeline(module: nn.Module, mb_args: tuple[Any, ...], mb_kwargs: dict[str, Any] | None = None,
             split_spec: dict[str, SplitPoint] | None = None,
             split_policy: Callable[[fx.GraphModule], fx.GraphModule] | None = None) -> Pipe:
    """Cut ``module`` into stages at its split points; ``mb_args``/``mb_kwargs`` are one microbatch's inputs."""
    if split_spec is not None and split_policy is not None:
        raise ValueError("Cannot specify both `split_spec` and `split_policy`")
    mb_args = _as_tuple(mb_args)
    mb_kwargs = mb_kwargs or {}
    tracer = _Tracer(dict(split_spec or {}))
    if split_spec:
        known = {name for name, _ in module.named_modules()}
        unknown = sorted(set(split_spec) - known)
        if unknown:
            raise ValueError(f"pipeline: split_spec names submodules {unknown} that the model does not have")
    try:
        graph = tracer.trace(module)
    except Exception as exc:
        raise RuntimeError(f"pipeline: torch.fx could not trace {type(module).__name__}: {exc}") from exc
    gm = fx.GraphModule(module, graph)
    if split_policy is not None:
        gm = split_policy(gm)
    where, n = _partition(gm.graph)
    graphs = _stage_graphs(gm, where, n)
    split_gm = fx.GraphModule(nn.Module(), fx.Graph())
    for k, graph in enumerate(graphs):
        # With the model as root, fx takes (shares, not copies) the submodules, parameters and buffers the stage's
        # graph reaches, in the order the graph reaches them: the stage's parameters keep the model's order.
        split_gm.add_module(f"submod_{k}", fx.GraphModule(module, graph, f"submod_{k}"))
    examples = []
    with torch.no_grad():
        values: tuple = mb_args
        for k in range(n):
            stage = getattr(split_gm, f"submod_{k}")
            outputs = _as_tuple(stage(*values, **(mb_kwargs if k == 0 else {})))
            if k < n - 1 and not all(isinstance(o, torch.Tensor) for o in outputs):
                kinds = [type(o).__name__ for o in outputs]
                raise PipeliningMetadataError(
                    f"pipeline: stage {k} would send {kinds} to stage {k + 1}; only tensors cross stage boundaries. "
                    "Move the split point so that the values crossing it are tensors."
                )
            examples.append((tuple(v for v in values if isinstance(v, torch.Tensor)),
                             tuple(o for o in outputs if isinstance(o, torch.Tensor))))
            values = outputs
    info = PipeInfo(gm.graph, n, False, [(_with_grad(i, k > 0), _with_grad(o, True))
                                         for k, (i, o) in enumerate(examples)])
    return Pipe(split_gm, n, info)


def _with_grad(tensors: tuple[torch.Tensor, ...], grad: bool) -> tuple[torch.Tensor, ...]:
    """Example tensors marked as needing a gradient where they are floating point (activations between stages)."""
    return tuple(t.detach().requires_grad_(grad and t.is_floating_point()) for t in tensors)
