"""``torchdist.nn.functional``: collectives that autograd differentiates through.

The c10d collectives write into their arguments and are invisible to autograd.
These (PyTorch's ``torch.distributed.nn.functional``) return their result as
tensors that carry a ``grad_fn``, so a loss computed from them can be
backpropagated across ranks. Each is a :class:`torch.autograd.Function` whose
backward is the collective's transpose, itself built from these Functions (so
double backward works too). Every rank must run the backward: it is a
collective.

=====================  =====================================================
forward                backward of the output gradient(s)
=====================  =====================================================
broadcast from src     reduce (SUM) to src; zeros on every other rank
reduce to dst          broadcast from dst: every rank gets dst's gradient
gather to dst          scatter of dst's gradients; the others' are ignored
scatter from src       gather to src; zeros on every other rank
all_gather             all_to_all, then the sum (a reduce_scatter SUM)
reduce_scatter         all_gather
all_to_all             all_to_all back
all_to_all_single      all_to_all_single back, the split sizes swapped
all_reduce(op)         all_reduce with the *same* op
=====================  =====================================================

These are PyTorch's definitions, kept with their quirks so that the same
program gives the same gradients:

- ``all_reduce``'s backward reduces the gradients with the forward's op: right
  for SUM and AVG, but for MAX, MIN and PRODUCT it is the max (min, product) of
  the ranks' gradients, not the derivative of the max.
- ``broadcast``'s backward decides who keeps the gradient by comparing ``src``
  (a global rank) with the rank *in the group*; ``gather`` and ``scatter``
  decide who is the root the same way. In a group whose ranks are not the
  global ones, these pick the wrong rank, as in PyTorch.
- ``reduce_scatter``, ``all_to_all`` and ``all_to_all_single`` write into the
  output tensors they are given and return them (autograd returns an alias of
  an output that is an argument); the others return new tensors.
- ``scatter`` takes ``*tensors``: a rank that is not ``src`` passes a list too
  (its tensors give the output's shape), not None.

``broadcast``, ``reduce_scatter``, ``all_gather``, ``all_to_all_single`` and
``all_reduce`` warn (FutureWarning) that they are deprecated, as PyTorch 2.13's
do. The ``group`` default is None (the default group): PyTorch's is
``group.WORLD`` read when its module is imported, which is None unless it was
imported after ``init_process_group``.
"""

from __future__ import annotations

import warnings

import torch
from torch.autograd import Function

from .._c10d import collectives as c10d
from .._c10d.init import get_rank, get_world_size
from .._process_group.process_group import ProcessGroup
from .._process_group.reduce_op import ReduceOp

__all__ = ["broadcast", "gather", "scatter", "reduce", "reduce_scatter", "all_gather", "all_to_all",
           "all_to_all_single", "all_reduce"]


def _check_not_compiling(name: str, suggestion: str | None = None) -> None:
    if torch.compiler.is_compiling():
        message = f"torchdist.nn.functional.{name} is not supported under torch.compile."
        if suggestion:
            message += f" Use {suggestion} instead."
        raise RuntimeError(message)


def _deprecated(name: str, replacement: str) -> None:
    # stacklevel 3: the warning points at the user's call, not at the public function
    warnings.warn(f"torchdist.nn.functional.{name} is deprecated (as torch.distributed.nn.functional.{name} is in "
                  f"PyTorch 2.13), use torch.distributed._functional_collectives.{replacement} instead.",
                  category=FutureWarning, stacklevel=3)


# -- the public functions -------------------------------------------------------------------------------


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None) -> torch.Tensor:
    """A new tensor holding ``src``'s ``tensor`` on every rank of ``group``."""
    _check_not_compiling("broadcast", "torch.distributed._functional_collectives.broadcast")
    _deprecated("broadcast", "broadcast")
    return _Broadcast.apply(src, group, tensor)


def gather(tensor: torch.Tensor, dst: int = 0, group: ProcessGroup | None = None) -> tuple[torch.Tensor, ...]:
    """One tensor per rank: on ``dst`` rank i's ``tensor``, on the other ranks zeros."""
    _check_not_compiling("gather")
    return _Gather.apply(dst, group, tensor)


def scatter(tensors: list[torch.Tensor], src: int = 0, group: ProcessGroup | None = None) -> torch.Tensor:
    """A new tensor holding ``src``'s ``tensors[rank]``; every rank passes a list of same-shaped tensors."""
    _check_not_compiling("scatter")
    return _Scatter.apply(src, group, *tensors)


def reduce(tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM,
           group: ProcessGroup | None = None) -> torch.Tensor:
    """A new tensor: on ``dst`` the reduction of every rank's ``tensor``; elsewhere what the backend left."""
    _check_not_compiling("reduce")
    return _Reduce.apply(dst, op, group, tensor)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: ReduceOp = ReduceOp.SUM,
                   group: ProcessGroup | None = None) -> torch.Tensor:
    """The reduction over ranks of their ``input_list[rank]``, written into ``output`` (if contiguous) and returned."""
    _check_not_compiling("reduce_scatter", "torch.distributed._functional_collectives.reduce_scatter_single")
    _deprecated("reduce_scatter", "reduce_scatter_single")
    return _ReduceScatter.apply(op, group, output, *input_list)


def all_gather(tensor: torch.Tensor, group: ProcessGroup | None = None) -> tuple[torch.Tensor, ...]:
    """Every rank's ``tensor``, in rank order, as new tensors."""
    _check_not_compiling("all_gather", "torch.distributed._functional_collectives.all_gather_single")
    _deprecated("all_gather", "all_gather_single")
    return _AllGather.apply(group, tensor)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group: ProcessGroup | None = None) -> tuple[torch.Tensor, ...]:
    """``output_tensor_list[j]`` receives rank j's ``input_tensor_list[rank]``; returns the list's tensors."""
    _check_not_compiling("all_to_all")
    return _AllToAll.apply(group, output_tensor_list, *input_tensor_list)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None,
                      group: ProcessGroup | None = None) -> torch.Tensor:
    """``input`` split along dim 0, chunk j sent to rank j; the chunks received, in rank order, in ``output``."""
    _check_not_compiling("all_to_all_single", "torch.distributed._functional_collectives.all_to_all_single")
    _deprecated("all_to_all_single", "all_to_all_single")
    return _AllToAllSingle.apply(group, output, output_split_sizes, input_split_sizes, input)


def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None) -> torch.Tensor:
    """A new (contiguous) tensor holding the reduction of every rank's ``tensor``."""
    _check_not_compiling("all_reduce", "torch.distributed._functional_collectives.all_reduce")
    _deprecated("all_reduce", "all_reduce")
    return _AllReduce.apply(op, group, tensor)


# -- the autograd Functions: forward runs the collective, backward its transpose -----------------------------
# Each backward returns one gradient per forward argument: None for src, op, group and the like.


class _Broadcast(Function):
    @staticmethod
    def forward(ctx, src: int, group: ProcessGroup | None, tensor: torch.Tensor) -> torch.Tensor:
        ctx.src, ctx.group = src, group
        ctx.rank = get_rank(group)  # a group rank, compared with the global src in backward (PyTorch's quirk)
        out = tensor.clone()
        c10d.broadcast(out, src, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad = _Reduce.apply(ctx.src, ReduceOp.SUM, ctx.group, grad_output)
        if ctx.src != ctx.rank:
            grad.zero_()
        return None, None, grad


class _Reduce(Function):
    @staticmethod
    def forward(ctx, dst: int, op: ReduceOp, group: ProcessGroup | None, tensor: torch.Tensor) -> torch.Tensor:
        ctx.dst, ctx.group = dst, group
        out = tensor.clone()
        c10d.reduce(out, dst, op=op, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return None, None, None, _Broadcast.apply(ctx.dst, ctx.group, grad_output)


class _Gather(Function):
    @staticmethod
    def forward(ctx, dst: int, group: ProcessGroup | None, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.dst, ctx.group = dst, group
        outs = [torch.zeros_like(tensor) for _ in range(get_world_size(group))]
        c10d.gather(tensor.contiguous(), outs if get_rank(group) == dst else None, dst, group=group)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor):
        return None, None, _Scatter.apply(ctx.dst, ctx.group, *grad_outputs)


class _Scatter(Function):
    @staticmethod
    def forward(ctx, src: int, group: ProcessGroup | None, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.src, ctx.group = src, group
        if any(t.size() != tensors[0].size() for t in tensors):
            raise AssertionError(f"scatter: every tensor must have one size, got {[tuple(t.size()) for t in tensors]}")
        out = torch.zeros_like(tensors[0])
        c10d.scatter(out, list(tensors) if get_rank(group) == src else None, src, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return (None, None) + _Gather.apply(ctx.src, ctx.group, grad_output)


class _ReduceScatter(Function):
    @staticmethod
    def forward(ctx, op: ReduceOp, group: ProcessGroup | None, output: torch.Tensor,
                *inputs: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        # A non-contiguous output is replaced by a contiguous copy, which the caller never sees (as PyTorch).
        output = output.contiguous()
        c10d.reduce_scatter(output, [t.contiguous() for t in inputs], op=op, group=group)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return (None, None, None) + _AllGather.apply(ctx.group, grad_output)


class _AllGather(Function):
    @staticmethod
    def forward(ctx, group: ProcessGroup | None, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        tensor = tensor.contiguous()
        outs = [torch.empty_like(tensor) for _ in range(get_world_size(group))]
        c10d.all_gather(outs, tensor, group=group)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor):
        # A reduce_scatter SUM, done as PyTorch does on gloo: an all_to_all, then the sum in rank order,
        # so that the rounding is the same.
        received = _AllToAll.apply(ctx.group, [torch.empty_like(g) for g in grad_outputs], *grad_outputs)
        return None, torch.sum(torch.stack(received), dim=0)


class _AllToAll(Function):
    @staticmethod
    def forward(ctx, group: ProcessGroup | None, outputs: list[torch.Tensor],
                *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        ctx.input_sizes = [inputs[i].size() for i in range(get_world_size(group))]
        c10d.all_to_all(outputs, [t.contiguous() for t in inputs], group=group)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor):
        like = grad_outputs[0]
        grads = [torch.empty(size, device=like.device, dtype=like.dtype) for size in ctx.input_sizes]
        return (None, None) + _AllToAll.apply(ctx.group, grads, *grad_outputs)


class _AllToAllSingle(Function):
    @staticmethod
    def forward(ctx, group: ProcessGroup | None, output: torch.Tensor, output_split_sizes: list[int] | None,
                input_split_sizes: list[int] | None, input: torch.Tensor) -> torch.Tensor:
        ctx.group, ctx.input_size = group, input.size()
        # backward sends back what was received: the split sizes swap roles
        ctx.output_split_sizes, ctx.input_split_sizes = input_split_sizes, output_split_sizes
        c10d.all_to_all_single(output, input, output_split_sizes=output_split_sizes,
                               input_split_sizes=input_split_sizes, group=group)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad = torch.empty(ctx.input_size, device=grad_output.device, dtype=grad_output.dtype)
        return None, None, None, None, _AllToAllSingle.apply(ctx.group, grad, ctx.output_split_sizes,
                                                             ctx.input_split_sizes, grad_output.contiguous())


class _AllReduce(Function):
    @staticmethod
    def forward(ctx, op: ReduceOp, group: ProcessGroup | None, tensor: torch.Tensor) -> torch.Tensor:
        ctx.op, ctx.group = op, group
        out = tensor.clone(memory_format=torch.contiguous_format)
        c10d.all_reduce(out, op=op, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        # the forward's op, whatever it is: see the module docstring
        return None, None, _AllReduce.apply(ctx.op, ctx.group, grad_output)
