"""The tensor collectives: what users call, with PyTorch's signatures and checks.

Each function: resolve the group (non-members warn and get None), translate roots
to group ranks, check what can be checked locally (list lengths, dtypes, element
counts) so a mistake raises (with PyTorch's exception type) before anything is
sent, stage non-contiguous tensors, and hand the op to the group's backend. What
can only be checked across ranks (another rank passed a different shape, op or
root) is caught by the backend's per-message fingerprints.

``async_op=True`` returns the backend's :class:`Work`; otherwise the call returns
None once the tensors hold the result.
"""

from __future__ import annotations

import math
import warnings
from datetime import timedelta

import torch

from .._process_group.process_group import ProcessGroup
from .._process_group.reduce_op import COMPLEX_REDUCE_OPS, RedOpType, ReduceOp, as_red_op
from .._process_group.work import Work
from ._args import (Staging, all_of, check_list, check_same_dtype, check_tensor, check_timeout, group_root,
                    member_group, read_apart)

__all__ = [
    "broadcast",
    "all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_coalesced",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "barrier",
]


_BITWISE = frozenset({RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR})
#: c10's names of integer dtypes, for the message PyTorch gives on an integer AVG.
_C10_NAMES = {torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char",
              torch.uint8: "Byte", torch.bool: "Bool"}


def _check_op(name: str, op: ReduceOp, tensors: list[torch.Tensor]) -> ReduceOp:
    if op is RedOpType.SUM:  # defined for every dtype
        return op
    if op is RedOpType.AVG:
        for t in tensors:
            if not (t.is_floating_point() or t.is_complex()):
                raise RuntimeError(f"{name}: AVG of {t.dtype} tensors: result type Float can't be cast to the "
                                   f"desired output type {_C10_NAMES.get(t.dtype, t.dtype)}; use SUM, or a "
                                   "floating-point tensor")
        return op
    kind, _ = as_red_op(op)
    if kind not in COMPLEX_REDUCE_OPS and any(t.is_complex() for t in tensors):
        # PyTorch checks this in Python (ValueError) for all_reduce only; elsewhere its backend refuses
        error = ValueError if name.startswith("all_reduce") else RuntimeError
        raise error(f"{name} does not support {kind.name} on complex tensors")
    if kind in _BITWISE and any(t.is_floating_point() for t in tensors):
        raise RuntimeError(f"{name}: {kind.name} is only defined for integer and bool tensors, "
                           f"got {tensors[0].dtype}")
    if kind is RedOpType.PREMUL_SUM and not all(t.is_floating_point() or t.is_complex() for t in tensors):
        raise RuntimeError(f"{name}: PREMUL_SUM multiplies by a floating-point factor, so it needs floating-point "
                           f"or complex tensors, got {tensors[0].dtype}; use SUM")
    return op


def _check_root_list(op: str, tensor: torch.Tensor, tensors: list[torch.Tensor] | None, size: int,
                     name: str, kind: str) -> None:
    """The root's list of a gather or scatter, as PyTorch checks it: given (ValueError),
    one tensor per rank, of ``tensor``'s dtype and shape (RuntimeError)."""
    if not tensors:
        root = "destination" if op == "gather" else "source"
        raise ValueError(f"{op}: Argument ``{name}`` must be specified on {root} rank.")
    if len(tensors) != size:
        raise RuntimeError(f"{op}: Incorrect {kind} list size {len(tensors)}. {kind.capitalize()} list size should be "
                           f"{size}")
    check_same_dtype(op, [tensor, *tensors])
    for i, t in enumerate(tensors):
        if t.shape != tensor.shape:
            raise RuntimeError(f"{op}: invalid tensor size at index {i} of {name} (expected {tuple(tensor.shape)}, "
                               f"got {tuple(t.shape)}); every tensor of {name} must have the shape of ``tensor``")


def broadcast(tensor: torch.Tensor, src: int | None = None, group: ProcessGroup | None = None, async_op: bool = False,
              group_src: int | None = None) -> Work | None:
    """Copy the root's ``tensor`` into every rank's ``tensor``."""
    pg = member_group(group, "broadcast")
    if pg is None:
        return None
    check_tensor("broadcast", tensor)
    root = group_root(pg, "broadcast", src, group_src)
    stage = Staging()
    return stage.finish(pg.backend.broadcast(stage.output(tensor), root, async_op=async_op), async_op)


def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
               async_op: bool = False) -> Work | None:
    """Reduce ``tensor`` across ranks, in place, on every rank."""
    pg = member_group(group, "all_reduce")
    if pg is None:
        return None
    if isinstance(tensor, torch.Tensor) and tensor.is_sparse:
        from .sparse import sparse_all_reduce  # built on the dense collectives of this module

        return sparse_all_reduce(pg, tensor, op, async_op)
    check_tensor("all_reduce", tensor)
    _check_op("all_reduce", op, [tensor])
    stage = Staging()
    return stage.finish(pg.backend.allreduce([stage.output(tensor)], op, async_op=async_op), async_op)


def _warn_coalesced(op: str) -> None:
    warnings.warn(f"`torchdist.{op}` will be deprecated (as `torch.distributed.{op}` in PyTorch 2.13); "
                  "use one collective per tensor, or flatten the tensors into one.", FutureWarning, stacklevel=3)


def _require_tensors(op: str, tensors: list[torch.Tensor]) -> None:
    """PyTorch's dispatcher has nothing to dispatch on without a tensor: NotImplementedError."""
    if len(tensors) == 0:
        raise NotImplementedError(f"{op}: There were no tensor arguments to this function (you passed an empty "
                                  "list of Tensors); pass at least one tensor")


def all_reduce_coalesced(tensors: list[torch.Tensor], op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
                         async_op: bool = False) -> torch.futures.Future | None:
    """``all_reduce`` of several tensors of one dtype in a single operation."""
    _warn_coalesced("all_reduce_coalesced")
    pg = member_group(group, "all_reduce_coalesced")
    if pg is None:
        return None
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    _require_tensors("all_reduce_coalesced", tensors)
    check_same_dtype("all_reduce_coalesced", tensors)
    _check_op("all_reduce_coalesced", op, tensors)
    stage = Staging()
    work = stage.finish(pg.backend.allreduce([stage.output(t) for t in tensors], op, async_op=async_op), async_op)
    return work.get_future() if async_op else None  # PyTorch returns the future of the coalesced ops


def reduce(tensor: torch.Tensor, dst: int | None = None, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
           async_op: bool = False, group_dst: int | None = None) -> Work | None:
    """Reduce ``tensor`` across ranks into the root's ``tensor`` (others may be clobbered)."""
    pg = member_group(group, "reduce")
    if pg is None:
        return None
    check_tensor("reduce", tensor)
    _check_op("reduce", op, [tensor])
    root = group_root(pg, "reduce", dst, group_dst)
    stage = Staging()
    return stage.finish(pg.backend.reduce(stage.output(tensor), root, op, async_op=async_op), async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: ProcessGroup | None = None,
               async_op: bool = False) -> Work | None:
    """``tensor_list[i]`` receives rank i's ``tensor``."""
    pg = member_group(group, "all_gather")
    if pg is None:
        return None
    outputs = check_list("all_gather", tensor_list, pg.size(), "tensor_list")
    check_same_dtype("all_gather", [tensor, *outputs])
    for i, out in enumerate(outputs):
        if out.numel() != tensor.numel():
            raise RuntimeError(
                f"all_gather: tensor_list[{i}] has {out.numel()} elements (shape {tuple(out.shape)}) but the "
                f"input has {tensor.numel()} (shape {tuple(tensor.shape)}); every output must match the input"
            )
    tensor = read_apart(tensor, outputs, own=pg.rank())
    stage = Staging()
    work = pg.backend.allgather([stage.output(t) for t in outputs], stage.input(tensor), async_op=async_op)
    return stage.finish(work, async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: ProcessGroup | None = None,
                           async_op: bool = False) -> Work | None:
    """``output_tensor`` is every rank's input concatenated along dim 0, in rank order."""
    warnings.warn(
        "all_gather_into_tensor is deprecated in PyTorch 2.13; use all_gather_single instead.",
        FutureWarning,
        stacklevel=2,
    )
    return all_gather_single(output_tensor, input_tensor, group, async_op)


def all_gather_single(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: ProcessGroup | None = None,
                      async_op: bool = False) -> Work | None:
    """2.13's name of ``all_gather_into_tensor``."""
    pg = member_group(group, "all_gather_single")
    if pg is None:
        return None
    check_same_dtype("all_gather_single", [output_tensor, input_tensor], RuntimeError)
    if output_tensor.numel() != pg.size() * input_tensor.numel():
        raise RuntimeError(
            f"all_gather_single: the output has {output_tensor.numel()} elements; it must hold world_size "
            f"({pg.size()}) x the input's {input_tensor.numel()}"
        )
    stage = Staging()
    work = pg.backend.allgather_into_tensor(stage.output(output_tensor), stage.input(input_tensor),
                                           async_op=async_op)
    per_rank = list(output_tensor.chunk(pg.size())) if async_op else None  # PyTorch's result: one view per rank
    return stage.finish(work, async_op, result=per_rank)


def all_gather_coalesced(output_tensor_lists: list[list[torch.Tensor]], input_tensor_list: list[torch.Tensor],
                         group: ProcessGroup | None = None, async_op: bool = False) -> torch.futures.Future | None:
    """``all_gather`` of several tensors; ``output_tensor_lists[r][i]`` gets rank r's ``input_tensor_list[i]``."""
    _warn_coalesced("all_gather_coalesced")
    pg = member_group(group, "all_gather_coalesced")
    if pg is None:
        return None
    _require_tensors("all_gather_coalesced", input_tensor_list)
    outputs = check_list("all_gather_coalesced", output_tensor_lists, pg.size(), "output_tensor_lists")
    for per_rank in outputs:
        check_list("all_gather_coalesced", per_rank, len(input_tensor_list), "each output list")
        for out, inp in zip(per_rank, input_tensor_list):
            if out.numel() != inp.numel():
                raise RuntimeError(f"all_gather_coalesced: an output tensor has {out.numel()} elements but the "
                                   f"input it receives has {inp.numel()}")
    check_same_dtype("all_gather_coalesced", [*input_tensor_list, *(t for lst in outputs for t in lst)])
    stage = Staging()
    works = [
        pg.backend.allgather([stage.output(outputs[r][i]) for r in range(pg.size())], stage.input(inp),
                             async_op=async_op)
        for i, inp in enumerate(input_tensor_list)
    ]
    work = stage.finish(all_of("all_gather_coalesced", works, outputs), async_op)
    return work.get_future() if async_op else None  # PyTorch returns the future; its value: the output lists


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int | None = None,
           group: ProcessGroup | None = None, async_op: bool = False, group_dst: int | None = None) -> Work | None:
    """The root's ``gather_list[i]`` receives rank i's ``tensor`` (root: ``dst``, default 0)."""
    pg = member_group(group, "gather")
    if pg is None:
        return None
    check_tensor("gather", tensor)
    root = group_root(pg, "gather", dst, group_dst, default=0 if group_dst is None else None)
    stage = Staging()
    if pg.rank() == root:
        _check_root_list("gather", tensor, gather_list, pg.size(), "gather_list", "output")
        tensor = read_apart(tensor, gather_list, own=root)
        outputs = [stage.output(t) for t in gather_list]
    else:
        if gather_list:
            raise ValueError("gather: requires empty output on non-root (gather_list is only given on dst)")
        outputs = None
    return stage.finish(pg.backend.gather(outputs, stage.input(tensor), root, async_op=async_op), async_op)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int | None = None,
            group: ProcessGroup | None = None, async_op: bool = False, group_src: int | None = None) -> Work | None:
    """Rank i's ``tensor`` receives the root's ``scatter_list[i]`` (root: ``src``, default 0)."""
    pg = member_group(group, "scatter")
    if pg is None:
        return None
    check_tensor("scatter", tensor)
    root = group_root(pg, "scatter", src, group_src, default=0 if group_src is None else None)
    stage = Staging()
    if pg.rank() == root:
        _check_root_list("scatter", tensor, scatter_list, pg.size(), "scatter_list", "input")
        inputs = [stage.input(read_apart(t, [tensor], own=0 if i == root else None))
                  for i, t in enumerate(scatter_list)]
    else:
        if scatter_list:
            raise ValueError("scatter: requires empty input on non-root (scatter_list is only given on src)")
        inputs = None
    return stage.finish(pg.backend.scatter(stage.output(tensor), inputs, root, async_op=async_op), async_op)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: ReduceOp = ReduceOp.SUM,
                   group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Rank i's ``output`` receives the reduction over ranks of their ``input_list[i]``."""
    pg = member_group(group, "reduce_scatter")
    if pg is None:
        return None
    inputs = check_list("reduce_scatter", input_list, pg.size(), "input_list")
    check_same_dtype("reduce_scatter", [output, *inputs])
    _check_op("reduce_scatter", op, [output])
    if inputs[pg.rank()].numel() != output.numel():
        raise RuntimeError(
            f"reduce_scatter: input_list[{pg.rank()}] has {inputs[pg.rank()].numel()} elements but the output "
            f"has {output.numel()}; they must match"
        )
    inputs = [read_apart(t, [output]) for t in inputs]  # partial sums land in the output: no input may alias it
    stage = Staging()
    work = pg.backend.reduce_scatter(stage.output(output), [stage.input(t) for t in inputs], op, async_op=async_op)
    return stage.finish(work, async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                          group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Rank r's ``output`` receives chunk r (along dim 0) of the reduced ``input``."""
    warnings.warn(
        "reduce_scatter_tensor is deprecated in PyTorch 2.13; use reduce_scatter_single instead.",
        FutureWarning,
        stacklevel=2,
    )
    return reduce_scatter_single(output, input, op, group, async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                          group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """2.13's name of ``reduce_scatter_tensor``."""
    pg = member_group(group, "reduce_scatter_single")
    if pg is None:
        return None
    check_same_dtype("reduce_scatter_single", [output, input], RuntimeError)
    _check_op("reduce_scatter_single", op, [output])
    if input.numel() != pg.size() * output.numel():
        raise RuntimeError(
            f"reduce_scatter_single: the input has {input.numel()} elements; it must hold world_size "
            f"({pg.size()}) x the output's {output.numel()}"
        )
    input = read_apart(input, [output])  # e.g. the output is the input's own chunk: partial sums land there
    stage = Staging()
    work = pg.backend.reduce_scatter_tensor(stage.output(output), stage.input(input), op, async_op=async_op)
    return stage.finish(work, async_op)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Rank i's ``output_tensor_list[j]`` receives rank j's ``input_tensor_list[i]``."""
    pg = member_group(group, "all_to_all")
    if pg is None:
        return None
    outputs = check_list("all_to_all", output_tensor_list, pg.size(), "output_tensor_list")
    inputs = check_list("all_to_all", input_tensor_list, pg.size(), "input_tensor_list")
    check_same_dtype("all_to_all", [*outputs, *inputs])
    me = pg.rank()
    if outputs[me].numel() != inputs[me].numel():  # what this rank sends itself: the sizes are all local
        raise RuntimeError(f"all_to_all: output_tensor_list[{me}] has {outputs[me].numel()} elements but "
                           f"input_tensor_list[{me}], which this rank sends itself, has {inputs[me].numel()}")
    inputs = [read_apart(t, outputs, own=me if i == me else None) for i, t in enumerate(inputs)]
    stage = Staging()
    work = pg.backend.alltoall([stage.output(t) for t in outputs], [stage.input(t) for t in inputs],
                               async_op=async_op)
    return stage.finish(work, async_op)


def _splits(op: str, tensor: torch.Tensor, sizes: list[int] | None, world: int, name: str) -> list[int]:
    rows = tensor.shape[0] if tensor.dim() > 0 else tensor.numel()
    if sizes is None or len(sizes) == 0:
        if rows % world:
            raise ValueError(f"{op}: dim 0 of the {name} ({rows}) is not divisible by world_size ({world}); "
                             f"pass {name}_split_sizes")
        return [rows // world] * world
    sizes = [int(s) for s in sizes]
    if len(sizes) != world or any(s < 0 for s in sizes) or sum(sizes) != rows:
        raise RuntimeError(f"{op}: {name}_split_sizes {sizes} must be {world} non-negative sizes summing to "
                           f"dim 0 of the {name} ({rows})")
    return sizes


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: ProcessGroup | None = None,
                      async_op: bool = False) -> Work | None:
    """Split ``input`` along dim 0; chunk j goes to rank j, arriving as its chunk ``rank``."""
    pg = member_group(group, "all_to_all_single")
    if pg is None:
        return None
    check_same_dtype("all_to_all_single", [output, input])
    if not output.is_contiguous() or not input.is_contiguous():
        raise ValueError("Tensors must be contiguous")
    world = pg.size()
    out_sizes = _splits("all_to_all_single", output, output_split_sizes, world, "output")
    in_sizes = _splits("all_to_all_single", input, input_split_sizes, world, "input")
    me = pg.rank()
    rows_out, rows_in = math.prod(output.shape[1:]), math.prod(input.shape[1:])  # elements per row (1 for 0-d)
    if out_sizes[me] * rows_out != in_sizes[me] * rows_in:
        raise RuntimeError(f"all_to_all_single: the chunk this rank sends itself has {in_sizes[me] * rows_in} "
                           f"elements in the input but {out_sizes[me] * rows_out} in the output")
    input = read_apart(input, [output])
    stage = Staging()
    out_chunks = [stage.output(t) for t in torch.split(output.view(-1) if output.dim() == 0 else output, out_sizes)]
    in_chunks = [stage.input(t) for t in torch.split(input.view(-1) if input.dim() == 0 else input, in_sizes)]
    return stage.finish(pg.backend.alltoall(out_chunks, in_chunks, async_op=async_op), async_op, result=[output])


def barrier(group: ProcessGroup | None = None, async_op: bool = False, device_ids=None,
            timeout: timedelta | None = None) -> Work | None:
    """Block until every rank of the group has arrived (and all earlier ops have finished).

    ``timeout``: the barrier's own limit (default: the group's); past it, the barrier
    fails naming the ranks that did not arrive, and the group is broken."""
    check_timeout(timeout)
    pg = member_group(group, "barrier")
    if pg is None:
        return None
    work = pg.backend.barrier(async_op=async_op, timeout=timeout)
    if async_op:
        return work
    work.wait()
    return None
