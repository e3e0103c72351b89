"""``ProcessGroup`` with its op methods: PyTorch's low-level ``pg.allreduce([t], opts)`` surface.

PyTorch's ``ProcessGroup`` methods are the C++ layer under its c10d functions; programs
call them directly (``dist.group.WORLD.allreduce([t])``, ``pg.broadcast(t, root=0)``).
Each returns a :class:`Work` the caller waits on, takes roots as *group* ranks, and has
the overloads of PyTorch 2.13 (an ``*Options`` object, or plain arguments). Here they
are a thin layer over the c10d functions, which already check arguments and stage
tensors the way the backends need: a method parses its overload, calls the c10d
function on this group with the group rank as ``group_src``/``group_dst``, and
hands back the Work. Misuse raises what PyTorch's backend raises: its checks are C++
``RuntimeError``s where the c10d front end's Python checks raise ``ValueError``.

An op's own timeout (``opts.timeout``, ``timeout=``) bounds that op, as in PyTorch's gloo:
the method sets it around its call (``_process_group.op_timeout``) and the backend fixes
the op's deadline from it when the op is issued. Unset, the group's timeout applies.

The class users get as ``torchdist.ProcessGroup`` is defined here, at the top of the
c10d layer: the layer-2 :class:`~torchdist._process_group.process_group.ProcessGroup`
(bookkeeping and backend, what backends and algorithms know) plus these methods,
which call the c10d functions (where the argument checks live, once). This module is
longer than most because it is one surface: PyTorch's 23 methods and their overloads.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch

from .._process_group import process_group
from .._process_group.op_timeout import op_timeout
from .._process_group.options import (UNSET_TIMEOUT, AllgatherOptions, AllreduceCoalescedOptions, AllreduceOptions,
                                     AllToAllOptions, BarrierOptions, BroadcastOptions, GatherOptions, ReduceOptions,
                                     ReduceScatterOptions, ScatterOptions)
from .._process_group.reduce_op import RedOpType, ReduceOp, as_red_op
from .._process_group.work import Work
from . import _args, collectives, p2p

__all__ = ["ProcessGroup", "ProcessGroupOps"]

_REQUIRED = object()


# -- overloads, as pybind11 resolves them --------------------------------------------
def _is_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor)


def _is_tensors(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in v)


def _is_tensor_lists(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(_is_tensors(x) for x in v)


def _is_int(v: Any) -> bool:
    return isinstance(v, int)


def _is_ints(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(x, int) for x in v)


def _is_op(v: Any) -> bool:
    return isinstance(v, ReduceOp)


def _is_timeout(v: Any) -> bool:
    return v is None or isinstance(v, timedelta)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is(cls: type) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, cls)


Form = tuple[tuple[str, Callable[[Any], bool], Any], ...]  # (parameter, accepts, default or _REQUIRED)


def _resolve(method: str, args: tuple, kwargs: dict, *forms: Form) -> tuple[int, dict]:
    """The first of ``forms`` that ``args``/``kwargs`` bind to and whose types they
    have, and the bound values: pybind11's overload resolution. None binds: TypeError."""
    for index, form in enumerate(forms):
        bound = _bind(form, args, kwargs)
        if bound is not None:
            return index, bound
    listed = "\n".join(f"    {i + 1}. ({', '.join(name for name, _, _ in form)})" for i, form in enumerate(forms))
    given = ", ".join([*(type(a).__name__ for a in args), *(f"{k}={type(v).__name__}" for k, v in kwargs.items())])
    raise TypeError(f"{method}(): incompatible function arguments. The following argument types are supported:\n"
                    f"{listed}\n\nInvoked with: {given}")


def _bind(form: Form, args: tuple, kwargs: dict) -> dict | None:
    if len(args) > len(form) or any(k not in {name for name, _, _ in form} for k in kwargs):
        return None
    bound = {}
    for i, (name, accepts, default) in enumerate(form):
        if i < len(args):
            if name in kwargs:
                return None
            value = args[i]
        else:
            value = kwargs.get(name, default)
        if value is _REQUIRED or (value is not default and not accepts(value)):
            return None
        bound[name] = value
    return bound


def _arg(name: str, accepts: Callable[[Any], bool], default: Any = _REQUIRED) -> tuple:
    return (name, accepts, default)


def _opts(cls: type) -> tuple:
    return _arg("opts", _is(cls), None)


def _timeout_arg() -> tuple:
    return _arg("timeout", _is_timeout, None)


# -- shared pieces ---------------------------------------------------------------------
@contextlib.contextmanager
def _backend_errors() -> Iterator[None]:
    """PyTorch's methods skip the Python checks that raise ValueError; its backend's own
    checks raise RuntimeError."""
    try:
        yield
    except ValueError as exc:
        raise RuntimeError(str(exc)) from exc


def _single(method: str, tensors: list, what: str = "tensor") -> torch.Tensor:
    """The one tensor of a list that PyTorch's gloo takes with one element only."""
    if not tensors:  # PyTorch's dispatcher, with no tensor to dispatch on: NotImplementedError
        collectives._require_tensors(method, tensors)
    if len(tensors) != 1:
        raise RuntimeError(f"{method}: requires a single-element {what} list, got {len(tensors)}")
    return tensors[0]


def _own_timeout(timeout: timedelta | None) -> timedelta | None:
    return None if timeout is None or timeout == UNSET_TIMEOUT else timeout


def _timeout_of(form: int, a: dict, opts: Any) -> timedelta | None:
    """The op's own timeout: ``opts.timeout`` in the options form (form 0), else the ``timeout`` argument."""
    return opts.timeout if form == 0 else a.get("timeout")


def _fold(tensors: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """The local reduction of several same-shaped tensors (gloo reduces every tensor of the list)."""
    kind, _ = as_red_op(op)
    fns = {RedOpType.SUM: torch.add, RedOpType.PRODUCT: torch.mul, RedOpType.MIN: torch.minimum,
           RedOpType.MAX: torch.maximum, RedOpType.BAND: torch.bitwise_and, RedOpType.BOR: torch.bitwise_or,
           RedOpType.BXOR: torch.bitwise_xor}
    if kind not in fns:
        raise RuntimeError(f"allreduce: {kind.name} of several tensors per rank is not supported")
    acc = tensors[0].clone()
    for t in tensors[1:]:
        acc = fns[kind](acc, t)
    return acc.to(tensors[0].dtype)


def _check_alike(method: str, tensors: list[torch.Tensor]) -> None:
    for i, t in enumerate(tensors):
        if t.dtype != tensors[0].dtype or t.shape != tensors[0].shape:
            raise RuntimeError(f"{method}: invalid tensor at index {i} (expected {tensors[0].dtype} "
                               f"{tuple(tensors[0].shape)}, got {t.dtype} {tuple(t.shape)})")


def _copy_into(work: Work, source: torch.Tensor, targets: list[torch.Tensor]) -> Work:
    """``work``, which also copies ``source`` into each of ``targets`` when it succeeds;
    its result becomes ``targets``."""
    def copy(done: Work) -> None:
        if done.is_success():
            for t in targets:
                if t is not source:
                    t.copy_(source)

    work._on_done(copy)
    work._outputs = list(targets)
    return work


def _failed(name: str, error: BaseException) -> Work:
    """A Work that has already failed with ``error``: wait() raises it."""
    work = Work(name)
    work._fail(error)
    return work


class ProcessGroupOps:
    """Mixin of ProcessGroup: the op methods. Ranks are group ranks."""

    def _run(self, name: str, async_op: bool, call: Callable[[bool], Work | None],
             outputs: list | None = None, timeout: timedelta | None = None) -> Work:
        """``call(async_op)`` on the front end, its errors as the backend's, its ops bounded by
        ``timeout`` if set; a synchronous call has finished when it returns, so it gets a
        completed Work."""
        with _backend_errors(), op_timeout(_own_timeout(timeout)):
            work = call(async_op)
        return work if work is not None else Work.completed(name, outputs)

    # -- reductions ------------------------------------------------------------------
    def allreduce(self, *args: Any, **kwargs: Any) -> Work:
        """``allreduce(tensors, opts)``, ``allreduce(tensors, op, timeout)`` or ``allreduce(tensor, op, timeout)``."""
        form, a = _resolve("allreduce", args, kwargs,
                           (_arg("tensors", _is_tensors), _opts(AllreduceOptions)),
                           (_arg("tensors", _is_tensors), _arg("op", _is_op, ReduceOp.SUM), _timeout_arg()),
                           (_arg("tensor", _is_tensor), _arg("op", _is_op, ReduceOp.SUM), _timeout_arg()))
        opts = a.get("opts") or AllreduceOptions()
        op, async_op = (opts.reduceOp, opts.asyncOp) if form == 0 else (a["op"], True)
        timeout = _timeout_of(form, a, opts)
        tensors = [a["tensor"]] if form == 2 else list(a["tensors"])
        collectives._require_tensors("allreduce", tensors)
        if len(tensors) == 1:
            return self._run("allreduce", async_op, lambda x: collectives.all_reduce(tensors[0], op, self, x),
                             tensors, timeout)
        _check_alike("allreduce", tensors)
        with _backend_errors():
            collectives._check_op("allreduce", op, tensors)
        acc = _fold(tensors, op)  # gloo reduces over every tensor of every rank, and writes each
        work = self._run("allreduce", True, lambda x: collectives.all_reduce(acc, op, self, x), None, timeout)
        return _copy_into(work, acc, tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: AllreduceCoalescedOptions | None = None) -> Work:
        """Each tensor reduced across ranks, in one operation (tensors of one dtype)."""
        _, a = _resolve("allreduce_coalesced", (tensors, opts), {},
                        (_arg("tensors", _is_tensors), _opts(AllreduceCoalescedOptions)))
        opts = a["opts"] or AllreduceCoalescedOptions()
        tensors = list(tensors)
        with _backend_errors():
            collectives._require_tensors("allreduce_coalesced", tensors)
            _args.check_same_dtype("allreduce_coalesced", tensors)
            collectives._check_op("allreduce_coalesced", opts.reduceOp, tensors)
        stage = _args.Staging()
        with op_timeout(_own_timeout(opts.timeout)):
            work = self.backend.allreduce([stage.output(t) for t in tensors], opts.reduceOp, async_op=opts.asyncOp)
        return stage.finish(work, True)

    def reduce(self, *args: Any, **kwargs: Any) -> Work:
        """``reduce(tensors, opts)`` or ``reduce(tensor, root, op, timeout)``."""
        form, a = _resolve("reduce", args, kwargs,
                           (_arg("tensors", _is_tensors), _opts(ReduceOptions)),
                           (_arg("tensor", _is_tensor), _arg("root", _is_int),
                            _arg("op", _is_op, ReduceOp.SUM), _timeout_arg()))
        opts = a.get("opts") or ReduceOptions()
        if form == 0:
            tensor, root, op, async_op = _single("reduce", a["tensors"]), opts.rootRank, opts.reduceOp, opts.asyncOp
            if opts.rootTensor != 0:
                raise RuntimeError(f"ProcessGroup.reduce: invalid root tensor: {opts.rootTensor}")
        else:
            tensor, root, op, async_op = a["tensor"], a["root"], a["op"], True
        return self._run("reduce", async_op,
                         lambda x: collectives.reduce(tensor, None, op, self, x, group_dst=root), [tensor],
                         _timeout_of(form, a, opts))

    def reduce_scatter(self, *args: Any, **kwargs: Any) -> Work:
        """``reduce_scatter(outputs, input_lists, opts)`` or ``reduce_scatter(output, inputs, op, timeout)``."""
        form, a = _resolve("reduce_scatter", args, kwargs,
                           (_arg("output_tensors", _is_tensors), _arg("input_tensors", _is_tensor_lists),
                            _opts(ReduceScatterOptions)),
                           (_arg("output", _is_tensor), _arg("input", _is_tensors),
                            _arg("op", _is_op, ReduceOp.SUM), _timeout_arg()))
        opts = a.get("opts") or ReduceScatterOptions()
        if form == 0:
            output = _single("reduce_scatter", a["output_tensors"], "output")
            inputs, op, async_op = _single("reduce_scatter", a["input_tensors"], "input"), opts.reduceOp, opts.asyncOp
        else:
            output, inputs, op, async_op = a["output"], a["input"], a["op"], True
        return self._run("reduce_scatter", async_op,
                         lambda x: collectives.reduce_scatter(output, list(inputs), op, self, x), [output],
                         _timeout_of(form, a, opts))

    def _reduce_scatter_base(self, outputTensor: torch.Tensor, inputTensor: torch.Tensor,
                             opts: ReduceScatterOptions | None = None) -> Work:
        """Rank r's output receives chunk r of the inputs reduced (PyTorch's older name)."""
        return self._reduce_scatter_single("_reduce_scatter_base", outputTensor, inputTensor, opts)

    def reduce_scatter_single(self, outputTensor: torch.Tensor, inputTensor: torch.Tensor,
                              opts: ReduceScatterOptions | None = None) -> Work:
        """Rank r's output receives chunk r of the inputs reduced."""
        return self._reduce_scatter_single("reduce_scatter_single", outputTensor, inputTensor, opts)

    def _reduce_scatter_single(self, name: str, output: Any, input: Any, opts: Any) -> Work:
        _resolve(name, (output, input, opts), {}, (_arg("outputTensor", _is_tensor),
                                                   _arg("inputTensor", _is_tensor), _opts(ReduceScatterOptions)))
        opts = opts or ReduceScatterOptions()
        return self._run(name, opts.asyncOp, lambda x: collectives.reduce_scatter_single(
            output, input, opts.reduceOp, self, x), [output], opts.timeout)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: ReduceScatterOptions | None = None) -> Work:
        """``reduce_scatter_single`` of each (output, input) pair, as one Work."""
        _resolve("reduce_scatter_tensor_coalesced", (outputs, inputs, opts), {},
                 (_arg("outputs", _is_tensors), _arg("inputs", _is_tensors), _opts(ReduceScatterOptions)))
        opts = opts or ReduceScatterOptions()
        return self._coalesced("reduce_scatter_tensor_coalesced", outputs, inputs,
                               lambda o, i: self.reduce_scatter_single(o, i, opts))

    def _coalesced(self, name: str, outputs: list, inputs: list, one: Callable[[Any, Any], Work]) -> Work:
        """One op per (output, input) pair, issued in order, completing as one Work. (A pair
        the front end refuses raises after the pairs before it were issued: every rank
        making the same mistake issues the same ops, so the group stays in step.)"""
        if len(outputs) != len(inputs):
            raise RuntimeError(f"{name}: {len(outputs)} outputs for {len(inputs)} inputs; they must match")
        return _args.all_of(name, [one(o, i) for o, i in zip(outputs, inputs)], list(outputs))

    # -- gathers -----------------------------------------------------------------------
    def allgather(self, *args: Any, **kwargs: Any) -> Work:
        """``allgather(output_lists, inputs, opts)`` or ``allgather(outputs, input, timeout)``."""
        form, a = _resolve("allgather", args, kwargs,
                           (_arg("output_tensors", _is_tensor_lists), _arg("input_tensors", _is_tensors),
                            _opts(AllgatherOptions)),
                           (_arg("output_tensors", _is_tensors), _arg("input_tensor", _is_tensor), _timeout_arg()))
        opts = a.get("opts") or AllgatherOptions()
        if form == 0:
            outputs = _single("allgather", a["output_tensors"], "output")
            input, async_op = _single("allgather", a["input_tensors"], "input"), opts.asyncOp
        else:
            outputs, input, async_op = a["output_tensors"], a["input_tensor"], True
        return self._run("allgather", async_op,
                         lambda x: collectives.all_gather(list(outputs), input, self, x), list(outputs),
                         _timeout_of(form, a, opts))

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
                            opts: AllgatherOptions | None = None) -> Work:
        """``output_lists[r][i]`` receives rank r's ``input_list[i]``, as one Work."""
        _resolve("allgather_coalesced", (output_lists, input_list, opts), {},
                 (_arg("output_lists", _is_tensor_lists), _arg("input_list", _is_tensors),
                  _opts(AllgatherOptions)))
        opts = opts or AllgatherOptions()
        collectives._require_tensors("allgather_coalesced", list(input_list))
        if len(output_lists) != self.size():
            raise RuntimeError(f"allgather_coalesced: {len(output_lists)} output lists; there must be one per rank "
                               f"({self.size()})")
        if any(len(lst) != len(input_list) for lst in output_lists):
            raise RuntimeError(f"allgather_coalesced: every output list must hold {len(input_list)} tensors, one "
                               "per input")
        per_input = [[lst[i] for lst in output_lists] for i in range(len(input_list))]  # [input][rank]
        return self._coalesced("allgather_coalesced", per_input, input_list,
                               lambda outs, inp: self.allgather([outs], [inp], opts))

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: AllgatherOptions | None = None) -> Work:
        """``all_gather_single`` of each (output, input) pair, as one Work."""
        _resolve("allgather_into_tensor_coalesced", (outputs, inputs, opts), {},
                 (_arg("outputs", _is_tensors), _arg("inputs", _is_tensors), _opts(AllgatherOptions)))
        opts = opts or AllgatherOptions()
        return self._coalesced("allgather_into_tensor_coalesced", outputs, inputs,
                               lambda o, i: self.all_gather_single(o, i, opts))

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: AllgatherOptions | None = None) -> Work:
        """``output`` is every rank's input concatenated in rank order (PyTorch's older name)."""
        return self._all_gather_single("_allgather_base", output, input, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: AllgatherOptions | None = None) -> Work:
        """``output`` is every rank's input concatenated in rank order."""
        return self._all_gather_single("all_gather_single", output, input, opts)

    def _all_gather_single(self, name: str, output: Any, input: Any, opts: Any) -> Work:
        _resolve(name, (output, input, opts), {},
                 (_arg("output", _is_tensor), _arg("input", _is_tensor), _opts(AllgatherOptions)))
        opts = opts or AllgatherOptions()
        return self._run(name, opts.asyncOp, lambda x: collectives.all_gather_single(output, input, self, x),
                         [output], opts.timeout)

    def gather(self, *args: Any, **kwargs: Any) -> Work:
        """``gather(output_lists, inputs, opts)`` or ``gather(outputs, input, root, timeout)``; only the
        root passes outputs (``[outputs]`` in the first form; ``[]`` elsewhere)."""
        form, a = _resolve("gather", args, kwargs,
                           (_arg("output_tensors", _is_tensor_lists), _arg("input_tensors", _is_tensors),
                            _opts(GatherOptions)),
                           (_arg("output_tensors", _is_tensors), _arg("input_tensor", _is_tensor),
                            _arg("root", _is_int), _timeout_arg()))
        opts = a.get("opts") or GatherOptions()
        if form == 0:
            lists, root, async_op = a["output_tensors"], opts.rootRank, opts.asyncOp
            input = _single("gather", a["input_tensors"], "input")
            if len(lists) > 1:
                raise RuntimeError("ProcessGroup.gather: requires a single-element output list")
            outputs = list(lists[0]) if lists else []
        else:
            outputs, input, root, async_op = list(a["output_tensors"]), a["input_tensor"], a["root"], True
        return self._run("gather", async_op,
                         lambda x: collectives.gather(input, outputs or None, None, self, x, group_dst=root),
                         [outputs] if outputs else [], _timeout_of(form, a, opts))

    def scatter(self, *args: Any, **kwargs: Any) -> Work:
        """``scatter(outputs, input_lists, opts)`` or ``scatter(output, inputs, root, timeout)``; only the
        root passes inputs (``[inputs]`` in the first form; ``[]`` elsewhere)."""
        form, a = _resolve("scatter", args, kwargs,
                           (_arg("output_tensors", _is_tensors), _arg("input_tensors", _is_tensor_lists),
                            _opts(ScatterOptions)),
                           (_arg("output_tensor", _is_tensor), _arg("input_tensors", _is_tensors),
                            _arg("root", _is_int), _timeout_arg()))
        opts = a.get("opts") or ScatterOptions()
        if form == 0:
            lists, root, async_op = a["input_tensors"], opts.rootRank, opts.asyncOp
            output = _single("scatter", a["output_tensors"], "output")
            if len(lists) > 1:
                raise RuntimeError("ProcessGroup.scatter: requires a single-element input list")
            inputs = list(lists[0]) if lists else []
        else:
            output, inputs, root, async_op = a["output_tensor"], list(a["input_tensors"]), a["root"], True
        return self._run("scatter", async_op,
                         lambda x: collectives.scatter(output, inputs or None, None, self, x, group_src=root),
                         [output], _timeout_of(form, a, opts))

    # -- broadcast and all-to-all ----------------------------------------------------------
    def broadcast(self, *args: Any, **kwargs: Any) -> Work:
        """``broadcast(tensors, opts)`` or ``broadcast(tensor, root, timeout)``. With several
        tensors, the root's ``tensors[opts.rootTensor]`` lands in every one of them."""
        form, a = _resolve("broadcast", args, kwargs,
                           (_arg("tensors", _is_tensors), _opts(BroadcastOptions)),
                           (_arg("tensor", _is_tensor), _arg("root", _is_int), _timeout_arg()))
        opts = a.get("opts") or BroadcastOptions()
        tensors = list(a["tensors"]) if form == 0 else [a["tensor"]]
        root, async_op = (opts.rootRank, opts.asyncOp) if form == 0 else (a["root"], True)
        collectives._require_tensors("broadcast", tensors)
        if not 0 <= opts.rootTensor < len(tensors):
            raise RuntimeError(f"ProcessGroup.broadcast: invalid root tensor: {opts.rootTensor}")
        _check_alike("broadcast", tensors)
        source = tensors[opts.rootTensor]
        work = self._run("broadcast", async_op, lambda x: collectives.broadcast(source, None, self, x, group_src=root),
                         tensors, _timeout_of(form, a, opts))
        return _copy_into(work, source, tensors) if len(tensors) > 1 else work

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: AllToAllOptions | None = None) -> Work:
        """Rank i's ``output_tensors[j]`` receives rank j's ``input_tensors[i]``."""
        _resolve("alltoall", (output_tensors, input_tensors, opts), {},
                 (_arg("output_tensors", _is_tensors), _arg("input_tensors", _is_tensors), _opts(AllToAllOptions)))
        opts = opts or AllToAllOptions()
        return self._run("alltoall", opts.asyncOp, lambda x: collectives.all_to_all(
            list(output_tensors), list(input_tensors), self, x), list(output_tensors), opts.timeout)

    def alltoall_base(self, *args: Any, **kwargs: Any) -> Work:
        """``alltoall_base(output, input, output_split_sizes, input_split_sizes, opts | timeout)``."""
        return self._all_to_all_single("alltoall_base", args, kwargs)

    def all_to_all_single(self, *args: Any, **kwargs: Any) -> Work:
        """``all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts | timeout)``."""
        return self._all_to_all_single("all_to_all_single", args, kwargs)

    def _all_to_all_single(self, name: str, args: tuple, kwargs: dict) -> Work:
        head = (_arg("output", _is_tensor), _arg("input", _is_tensor), _arg("output_split_sizes", _is_ints),
                _arg("input_split_sizes", _is_ints))
        form, a = _resolve(name, args, kwargs, (*head, _opts(AllToAllOptions)), (*head, _timeout_arg()))
        opts = a.get("opts") or AllToAllOptions()
        async_op = opts.asyncOp if form == 0 else True
        output = a["output"]
        try:  # gloo checks the split sizes when the op runs: they fail its Work, not the call
            collectives._splits(name, output, a["output_split_sizes"], self.size(), "output")
            collectives._splits(name, a["input"], a["input_split_sizes"], self.size(), "input")
        except (ValueError, RuntimeError) as exc:
            return _failed(name, RuntimeError(str(exc)))
        return self._run(name, async_op, lambda x: collectives.all_to_all_single(
            output, a["input"], list(a["output_split_sizes"]), list(a["input_split_sizes"]), self, x), [output],
            _timeout_of(form, a, opts))

    # -- barriers --------------------------------------------------------------------------
    def barrier(self, *args: Any, **kwargs: Any) -> Work:
        """``barrier(opts)`` or ``barrier(timeout)``: a Work that completes once every rank arrived."""
        form, a = _resolve("barrier", args, kwargs, (_opts(BarrierOptions),), (_timeout_arg(),))
        opts = a.get("opts") or BarrierOptions()
        timeout, async_op = (opts.timeout, opts.asyncOp) if form == 0 else (a["timeout"], True)
        return self._run("barrier", async_op, lambda x: collectives.barrier(self, x, timeout=_own_timeout(timeout)))

    def monitored_barrier(self, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """A barrier that names the ranks that did not arrive (see ``torchdist.monitored_barrier``)."""
        _resolve("monitored_barrier", (timeout, wait_all_ranks), {},
                 (_timeout_arg(), _arg("wait_all_ranks", _is_bool, False)))
        p2p.monitored_barrier(self, timeout, wait_all_ranks)

    # -- point to point ----------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> Work:
        """Send ``tensors[0]`` to group rank ``dstRank``; the Work completes once it is handed off."""
        _resolve("send", (tensors, dstRank, tag), {},
                 (_arg("tensors", _is_tensors), _arg("dstRank", _is_int), _arg("tag", _is_int)))
        tensor = self._p2p_tensor("send", tensors)
        with _backend_errors():
            return p2p._post_send(tensor, None, self, tag, dstRank, async_op=True)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> Work:
        """Receive into ``tensors[0]`` from group rank ``srcRank``."""
        _resolve("recv", (tensors, srcRank, tag), {},
                 (_arg("tensors", _is_tensors), _arg("srcRank", _is_int), _arg("tag", _is_int)))
        tensor = self._p2p_tensor("recv", tensors)
        with _backend_errors():
            return p2p._post_recv(tensor, None, self, tag, srcRank, async_op=True)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Work:
        """Receive into ``tensors[0]`` from whichever rank sends first; ``work._source_rank()`` tells which."""
        _resolve("recv_anysource", (tensors, tag), {}, (_arg("arg0", _is_tensors), _arg("arg1", _is_int)))
        tensor = self._p2p_tensor("recv", tensors)
        with _backend_errors():
            return p2p._post_recv(tensor, None, self, tag, None, async_op=True)

    @staticmethod
    def _p2p_tensor(method: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        if not tensors:
            collectives._require_tensors(method, tensors)
        if len(tensors) != 1:
            raise RuntimeError(f"ProcessGroup::{method} takes a single tensor")
        return tensors[0]


class ProcessGroup(ProcessGroupOps, process_group.ProcessGroup):
    """PyTorch's ``ProcessGroup``: the group every c10d call creates, with the op methods above."""
