"""The Reducer: averages gradients across ranks while backward is still running.

Design after Li et al., "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training" (VLDB 2020), section 3.2 and Algorithm 1:

- an autograd hook on every parameter (``register_post_accumulate_grad_hook``)
  fires once its gradient for the iteration has been accumulated into ``.grad``;
  the hook *marks the parameter ready*: a large parameter's ``.grad`` is itself
  the flat tensor of its solo bucket; a small one is copied into its slot of a
  coalesced bucket (with ``gradient_as_bucket_view`` the ``.grad`` *is* that
  slot and nothing is copied). See ``bucket.py``. The average is an all-reduce
  with ``ReduceOp.AVG``, which the backends finish where each piece is reduced
  (1/p of the elements per rank, in cache) instead of a pass over every
  gradient; only ``join(divide_by_initial_world_size=False)`` divides the
  gradients first, by the count of ranks still training;
- when the last parameter of a bucket is ready, the bucket's all-reduce (or the
  registered communication hook) is issued without waiting for it, so it overlaps
  the rest of backward. Buckets are launched strictly in index order, because
  every rank must issue the same collectives in the same order (section 3.2.3).
  They are issued as ops their caller waits on later (``_issue_all_reduce``), not
  as ``async_op=True`` ones: every rank waits on them at the end of backward and
  issues nothing in between that a peer needs first, so a backend may run them
  on this thread (shared memory: right here; TCP: large ones on its worker, small
  ones when waited on) instead of a worker thread that would contend with
  backward for the GIL and the core. Where the backend says a worker runs beside
  the caller's compute (``async_overlaps_compute``: shared memory on a host with
  two cores per rank) they are ``async_op=True``, and overlap backward;
- a callback queued on the autograd engine runs when backward ends: it waits for
  every bucket in order and writes each one's averaged gradients back to
  ``.grad`` as soon as it is reduced (nothing to write for a solo bucket);
- after the first iteration the buckets are rebuilt in the order the gradients
  actually arrived, rank 0's order broadcast so that all ranks agree;
- under distributed autograd (``torchdist.autograd.backward``) gradients go to the
  backward's context, never to ``.grad``: the engine runs a second hook per
  parameter (``autograd.engine.register_post_accumulate_hook``), and the reducer
  reads and writes the gradients there (``_grad``, ``_set_grad``), as PyTorch's.

Iteration state machine (``prepare_for_backward`` is called by DDP's forward)::

    idle ──forward (grad sync on)──▶ expecting hooks ──first hook──▶ reducing
      ▲                                   │                          │
      │            forward, no backward ──┘ (reset at next forward)  │
      └─────── finalize: all buckets reduced, grads written ◀─────────┘
               not all buckets ready (a parameter got no gradient):
               the next forward raises "Expected to have finished reduction ..."

Unused parameters (section 3.2.4): with ``find_unused_parameters`` the forward's
outputs are traced back through the autograd graph; parameters not reached are
marked ready at the first hook (contributing the gradient they hold, zeros if
none), and a bitmap of locally used parameters (a hook fired with a gradient,
in this backward or a ``no_sync`` one since the last reduction) is all-reduced
after the last bucket, so that a parameter unused on every rank keeps its
``.grad`` untouched (None stays None) and one used on some ranks gets the average.
With ``static_graph`` the first iteration only counts hook firings (which also
supports a parameter used several times, e.g. by reentrant checkpointing) and
reduces every bucket at the end of backward; later iterations replay the counts.

The module is over 400 lines because the iteration state above is one piece:
splitting it would spread the invariants over several files.
"""

from __future__ import annotations

import functools
import logging
import warnings
import weakref
from typing import Callable, Sequence

import torch

from .._algorithms.shm_direct import SMALL_BYTES
from .._c10d.collectives import broadcast
from .._c10d.sparse import sparse_all_reduce
from .._process_group.reduce_op import ReduceOp
from ..autograd.engine import accumulating_context, register_post_accumulate_hook
from .bucket import Bucket, GradBucket, assign_buckets
from .config import DDPConfig

__all__ = ["Reducer"]

logger = logging.getLogger(__name__)

_NOT_FINISHED = "Expected to have finished reduction in the prior iteration before starting a new one. "

_UNUSED_HINT = (
    _NOT_FINISHED + "This error indicates that your module has parameters that were not used in producing loss. "
    "You can enable unused parameter detection by passing the keyword argument `find_unused_parameters=True` to "
    "`torchdist.DistributedDataParallel`, and by \nmaking sure all `forward` function outputs participate in "
    "calculating loss. \nIf you already have done the above, then the distributed data parallel module wasn't "
    "able to locate the output tensors in the return value of your module's `forward` function. Please include "
    "the loss function and the structure of the return value of `forward` of your module when reporting this "
    "issue (e.g. list, dict, iterable).")

_ALL_USED_WARNING = (
    "find_unused_parameters=True was specified in DDP constructor, but did not find any unused parameters in the "
    "forward pass. This flag results in an extra traversal of the autograd graph every iteration,  which can "
    "adversely affect performance. If your model indeed never has any unused parameters in the forward pass, "
    "consider turning this flag off. Note that this warning may be a false positive if your model has flow control "
    "causing later iterations to have unused parameters.")

_UNUSED_THEN_USED = (
    "Your training graph has changed in this iteration, e.g., one parameter is unused in first iteration, but "
    "then got used in the second iteration. this is not compatible with static_graph set to True.")
_GRAPH_CHANGED = (
    "your training graph has changed in this iteration, e.g., one parameter is used in first iteration, but then "
    "got unused in the second iteration. this is not compatible with static_graph set to True.")


@functools.cache
def _warn_all_used() -> None:
    """PyTorch's warning when find_unused_parameters finds nothing, once per process (TORCH_WARN_ONCE)."""
    warnings.warn(_ALL_USED_WARNING, UserWarning, stacklevel=2)


def _no_entries(param: torch.Tensor) -> torch.Tensor:
    """A sparse gradient of ``param`` with no entries, laid out as an embedding's (one
    sparse dimension): what a rank without a gradient contributes to a sparse bucket."""
    return torch.sparse_coo_tensor(torch.empty((1, 0), dtype=torch.int64),
                                   torch.empty((0, *param.shape[1:]), dtype=param.dtype), param.shape,
                                   check_invariants=False)  # valid by construction


def _grad_hook(reducer_ref: "weakref.ref[Reducer]", index: int) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        reducer = reducer_ref()
        if reducer is not None:
            reducer._on_grad(index)
    return hook


def reached_leaves(outputs: Sequence[torch.Tensor]) -> set[int]:
    """The ids of the leaf tensors (parameters) that the autograd graph of ``outputs`` reaches."""
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    # Keyed by id, holding each node's Python wrapper: torch frees a node's wrapper once
    # nothing references it and makes a new one at the next access, and a freed
    # wrapper's id may go to the next wrapper made, which would then look seen, and its
    # branch would be skipped (it did under torch 2.11).
    seen = {id(fn): fn for fn in stack}
    reached: set[int] = set()
    while stack:
        fn = stack.pop()
        variable = getattr(fn, "variable", None)  # AccumulateGrad: a leaf
        if variable is not None:
            reached.add(id(variable))
        for nxt, _ in fn.next_functions:
            if nxt is not None and id(nxt) not in seen:
                seen[id(nxt)] = nxt
                stack.append(nxt)
    return reached


class Reducer:
    """Buckets the gradients of ``params`` and all-reduces them during backward."""

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str], group,
                 config: DDPConfig, expect_sparse: Sequence[bool] | None = None) -> None:
        """``expect_sparse[i]``: parameter i gets sparse gradients (a bucket of its own)."""
        self._params = list(params)
        self._names = list(names)
        self._expect_sparse = list(expect_sparse) if expect_sparse is not None else [False] * len(self._params)
        self._group = group
        self._world = group.size()
        self._config = config
        self._static = config.static_graph
        self._find_unused = config.find_unused_parameters and not config.static_graph
        self._comm_hook: Callable | None = None
        self._comm_state = None
        n = len(self._params)
        # iteration state (see the module docstring)
        self._expect_hooks = False
        self._require_finalize = False
        self._finalize_queued = False
        self._first_hook_seen = False
        self._ready = [False] * n
        self._next_bucket = 0
        self._unused: list[int] = []
        self._locally_used = torch.zeros(n, dtype=torch.int32)
        self._used_work = None
        self._divisor: int | None = None
        self._join_work = None
        self._divide_by_initial_world_size = True
        self._context = None  # the distributed autograd context this backward's gradients are in
        # static graph: hook counts recorded in the first iteration
        self._static_done = False
        self._counts = [0] * n
        self._counts_left: list[int] = []
        self._global_used: list[bool] | None = None
        # bucket rebuild: arrival order of the first synchronized backward
        self._has_rebuilt = False
        self._arrival: list[int] = []
        self._rebuild_order: list[int] | None = None
        self.num_iterations = 0
        self.num_backward = 0
        self._buckets: list[Bucket] = []
        self._where: list[tuple[int, int]] = []
        self._handles: list = []  # before anything can fail: __del__ removes them
        self._build(list(reversed(range(n))))
        ref = weakref.ref(self)
        for i, p in enumerate(self._params):
            self._handles.append(p.register_post_accumulate_grad_hook(_grad_hook(ref, i)))
            self._handles.append(register_post_accumulate_hook(p, _grad_hook(ref, i)))

    # -- buckets ---------------------------------------------------------------------------
    def _build(self, order: list[int]) -> None:
        """(Re)create the buckets over ``order``; with bucket views, point ``.grad`` at them."""
        groups = assign_buckets(self._params, order, self._config.size_limits(), self._config.solo_param_bytes,
                                self._expect_sparse)
        allocate = self._symmetric_allocator()
        self._buckets = [Bucket(i, idx, [self._params[j] for j in idx], solo, allocate,
                                sparse=solo and self._expect_sparse[idx[0]])
                         for i, (idx, solo) in enumerate(groups)]
        self._where = [(0, 0)] * len(self._params)
        for bucket in self._buckets:
            for slot, index in enumerate(bucket.param_indices):
                self._where[index] = (bucket.index, slot)
        if self._config.gradient_as_bucket_view:
            with torch.no_grad():
                for bucket in self._buckets:
                    if bucket.solo:
                        continue  # the gradient is its own bucket
                    for p, view in zip(bucket.params, bucket.views):
                        if p.grad is not None:
                            view.copy_(p.grad)
                            p.grad = view
        logger.debug("reducer: %d buckets of %s bytes", len(self._buckets), [b.nbytes for b in self._buckets])

    def _symmetric_allocator(self) -> Callable[[int, torch.dtype], torch.Tensor | None] | None:
        """Coalesced buckets in the group's symmetric memory where it has one (backend shm):
        their all-reduce then reads the peers' buckets where they lie, with no copy into
        the transport's buffers. Small buckets gain nothing (one step either way).
        An allocation is freed with its last tensor: the first iteration's buckets
        after the rebuild, every bucket with the reducer."""
        allocate = getattr(self._group.backend, "allocate_symmetric", None)
        if allocate is None or any(p.device.type != "cpu" for p in self._params):
            return None

        def symmetric(numel: int, dtype: torch.dtype) -> torch.Tensor | None:
            nbytes = numel * torch.empty(0, dtype=dtype).element_size()
            return allocate(nbytes).view(dtype) if nbytes > SMALL_BYTES else None
        return symmetric

    @property
    def buckets(self) -> list[Bucket]:
        return self._buckets

    def bucket_indices(self) -> list[list[int]]:
        return [list(b.param_indices) for b in self._buckets]

    def _should_rebuild(self) -> bool:
        return (self._static or not self._find_unused) and not self._has_rebuilt

    def rebuild_buckets(self) -> bool:
        """At the start of a forward: rebuild buckets in arrival order if the first iteration recorded one."""
        self.ensure_prior_reduction_finished()
        if self._rebuild_order is None or not self._should_rebuild():
            return False
        order = torch.tensor(self._rebuild_order, dtype=torch.int64)
        broadcast(order, group_src=0, group=self._group)  # every rank takes rank 0's order
        self._rebuild_order = None
        self._has_rebuilt = True
        self._build(order.tolist())
        logger.info("reducer: buckets rebuilt in gradient arrival order: %s", self.bucket_indices())
        return True

    def push_all_rebuilt_params(self) -> None:
        """On a joined rank: supply a (default) order so that its rebuild matches the others'."""
        if self._should_rebuild() and self._rebuild_order is None:
            self._rebuild_order = list(reversed(range(len(self._params))))

    def set_static_graph(self) -> None:
        """``DDP._set_static_graph()``: switch to static-graph mode before the first iteration."""
        if self.num_backward > 0 or self._require_finalize:
            raise RuntimeError("_set_static_graph() must be called before the first training iteration")
        self._static = True
        self._find_unused = False

    # -- communication hooks and join -------------------------------------------------------
    def register_comm_hook(self, state, hook: Callable) -> None:
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        self._comm_hook, self._comm_state = hook, state

    def set_forward_pass_work_handle(self, work, divide_by_initial_world_size: bool) -> None:
        """Join: the forward's all-reduce of ones counts the ranks that have not joined
        (None outside a join: all ranks take part)."""
        self._join_work = work
        self._divide_by_initial_world_size = divide_by_initial_world_size

    def match_all_reduce_for_joined(self) -> None:
        """On a joined rank: shadow one backward's collectives with zero gradients.

        A coalesced bucket is shadowed by its own flat tensor, zeroed and restored
        afterwards: in symmetric memory its all-reduce must name the same place as
        the active ranks' (with bucket views it also holds this rank's ``.grad``)."""
        pending, restore = [], []
        for bucket in self._buckets:
            if bucket.sparse:
                zeros = _no_entries(bucket.params[0])
            elif bucket.solo:
                zeros = torch.zeros(bucket.numel, dtype=bucket.dtype)
            else:
                zeros = bucket.storage()
                restore.append((zeros, zeros.clone()))
                zeros.zero_()
            if self._comm_hook is None:
                pending.append(self._issue_all_reduce(zeros, self._bucket_op()))
            else:
                pending.append(self._run_hook(GradBucket(bucket.index, zeros, bucket.params, bucket.offsets,
                                                         bucket.index == len(self._buckets) - 1)))
        if self._find_unused:
            pending.append(self._issue_all_reduce(torch.zeros_like(self._locally_used), ReduceOp.SUM))
        for item in pending:
            item.wait()
        with torch.no_grad():
            for storage, saved in restore:
                storage.copy_(saved)

    # -- the iteration ------------------------------------------------------------------------
    def ensure_prior_reduction_finished(self) -> None:
        if not self._require_finalize:
            return
        missing = [i for i, ready in enumerate(self._ready) if not ready]
        if self._static and self._static_done:
            raise RuntimeError(f"{_NOT_FINISHED}This error indicates that {_GRAPH_CHANGED} Parameter indices which "
                               f"did not receive grad for rank {self._group.rank()}: {' '.join(map(str, missing))}"
                               f"\nParameters which did not receive grad for rank {self._group.rank()}: "
                               f"{', '.join(self._names[i] for i in missing)}")
        raise RuntimeError(
            _UNUSED_HINT
            + f"\nParameter indices which did not receive grad for rank {self._group.rank()}: "
            + " ".join(str(i) for i in missing)
            + f"\nParameters which did not receive grad for rank {self._group.rank()}: "
            + ", ".join(self._names[i] for i in missing))

    def prepare_for_forward(self) -> None:
        self.num_iterations += 1

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor]) -> None:
        """Called by a forward whose backward must reduce gradients: reset the iteration state."""
        self.ensure_prior_reduction_finished()
        self._expect_hooks = True
        self._finalize_queued = False
        self._first_hook_seen = False
        self._ready = [False] * len(self._params)
        self._next_bucket = 0
        self._used_work = None
        self._divisor = None
        self._context = None
        for bucket in self._buckets:
            bucket.reset()
        if self._should_rebuild() and self._rebuild_order is None:
            self._arrival = []
        if self._static:
            if self._static_done:
                self._counts_left = list(self._counts)
            else:
                self._counts = [0] * len(self._params)
        if self._find_unused:
            self._unused = self._search_unused(outputs)

    def disable_hooks(self) -> None:
        """A forward under ``no_sync``: its backward only accumulates gradients locally."""
        self._expect_hooks = False

    def _search_unused(self, outputs: Sequence[torch.Tensor]) -> list[int]:
        """Indices of parameters that the autograd graph of ``outputs`` does not reach."""
        reached = reached_leaves(outputs)
        unused = [i for i, p in enumerate(self._params) if id(p) not in reached]
        if unused:
            logger.debug("reducer: unused parameters this iteration: %s", [self._names[i] for i in unused])
        else:
            _warn_all_used()
        return unused

    def queue_finalize(self) -> None:
        """Arrange for ``_finalize_backward`` to run when the current backward pass ends."""
        if self._expect_hooks and not self._finalize_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
            self._finalize_queued = True

    def _on_grad(self, index: int) -> None:
        """The autograd hook of parameter ``index``: its gradient has been accumulated."""
        self._context = accumulating_context()
        if self._tracks_used() and self._grad(self._params[index]) is not None:
            # Locally used, also in a no_sync backward: the next synced backward reduces
            # what accumulated. (A hook may fire without a gradient, for an output the
            # loss did not use: that is no use, and .grad stays None, as in PyTorch.)
            self._locally_used[index] = 1
        if not self._expect_hooks:
            return
        self._require_finalize = True
        if self._static and not self._static_done:  # first iteration: only count
            if self._counts[index] == 0:
                self._arrival.append(index)
            self._counts[index] += 1
            return
        if not self._first_hook_seen:
            self._first_hook_seen = True
            self._mark_unused_ready()
        if self._static:
            left = self._counts_left[index] - 1
            if left < 0:
                if self._counts[index] == 0:  # PyTorch's words, then which parameter
                    raise RuntimeError(f"{_UNUSED_THEN_USED}\nParameter: {self._names[index]}")
                raise RuntimeError(f"Parameter {self._names[index]} got more gradients than in the first "
                                   f"iteration ({self._counts[index]}): your training graph has changed in this "
                                   "iteration. this is not compatible with static_graph set to True.")
            self._counts_left[index] = left
            if left > 0:
                return
        self._mark_ready(index, used=True)

    def _mark_unused_ready(self) -> None:
        if self._find_unused:
            unused = self._unused
        elif self._static and self._static_done:
            unused = [i for i, c in enumerate(self._counts) if c == 0]
        else:
            return
        for i in unused:
            if not self._ready[i]:
                self._mark_ready(i, used=False)

    def _mark_ready(self, index: int, used: bool) -> None:
        if self._ready[index]:
            raise RuntimeError(
                "Expected to mark a variable ready only once. This error is caused by one of the following "
                "reasons: 1) Use of a module parameter outside the `forward` function. Please make sure model "
                "parameters are not shared across multiple concurrent forward-backward passes. or try to use "
                "_set_static_graph() as a workaround if this module graph does not change during training loop."
                "2) Reused parameters in multiple reentrant backward passes. For example, if you use multiple "
                "`checkpoint` functions to wrap the same part of your model, it would result in the same set of "
                "parameters been used by different reentrant backward passes multiple times, and hence marking a "
                "variable ready multiple times. DDP does not support such use cases in default. You can try to "
                "use _set_static_graph() as a workaround if your module graph does not change over iterations.\n"
                f"Parameter at index {index} with name {self._names[index]} has been marked as ready twice. "
                "This means that multiple autograd engine hooks have fired for this particular parameter during "
                "this iteration.")
        self._ready[index] = True
        if used and not self._static and self._should_rebuild() and self._rebuild_order is None:
            self._arrival.append(index)
        bucket_index, slot = self._where[index]
        bucket = self._buckets[bucket_index]
        self._copy_in(bucket, slot, used)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready_buckets()

    def _bucket_op(self) -> ReduceOp:
        """AVG when the divisor is the group size; else SUM of gradients divided first.

        Every rank, a joined one shadowing the others included, picks the same op:
        it depends only on the ``join`` argument, not on this iteration's count."""
        return ReduceOp.AVG if self._divide_by_initial_world_size else ReduceOp.SUM

    def _pre_divisor(self) -> int | None:
        """What to divide a gradient by before its all-reduce (None: nothing)."""
        if self._comm_hook is not None or self._divide_by_initial_world_size:
            return None  # the hook averages, or the all-reduce does (AVG)
        if self._divisor is None:
            self._divisor = self._world
            if self._join_work is not None:
                self._join_work.wait()
                self._divisor = int(self._join_work.result()[0].item())
        return self._divisor

    def _copy_in(self, bucket: Bucket, slot: int, used: bool) -> None:
        """Put the parameter's gradient (divided first if ``_pre_divisor`` says so) into its bucket.

        Solo bucket: the ``.grad`` itself, divided in place, when it is dense,
        contiguous, not part of a graph and the parameter was used; otherwise (and
        for a coalesced bucket) the slot of the bucket's own flat tensor. An unused
        parameter contributes the gradient it holds (accumulated under no_sync, or
        left from an earlier iteration), zeros if none, as PyTorch's reducer does."""
        p = bucket.params[slot]
        grad = self._grad(p)
        if bucket.sparse:
            self._take_sparse(bucket)
            return
        if bucket.solo:
            if (used and grad is not None and grad.layout == torch.strided and grad.is_contiguous()
                    and not grad.requires_grad):
                bucket.use_grad(grad)
                factor = self._pre_divisor()
                if factor is not None and factor != 1:
                    with torch.no_grad():
                        grad.div_(factor)
                return
            bucket.use_storage()
        view = bucket.views[slot]
        with torch.no_grad():
            if grad is None:
                view.zero_()
                return
            if grad.is_sparse:
                grad = grad.to_dense()
            factor = self._pre_divisor()
            if self._config.gradient_as_bucket_view:
                if grad.data_ptr() != view.data_ptr():
                    view.copy_(grad)
                    self._set_grad(p, view)
                if factor is not None and factor != 1:
                    view.div_(factor)
            elif factor is not None and factor != 1:
                torch.div(grad, factor, out=view)
            else:
                view.copy_(grad)

    def _take_sparse(self, bucket: Bucket) -> None:
        """A sparse bucket's buffer: the parameter's sparse gradient divided as a dense one
        would be (SUM is the only reduction of sparse tensors), or no entries if none."""
        p, name = bucket.params[0], self._names[bucket.param_indices[0]]
        grad = self._grad(p)
        if grad is None:
            bucket.buffer = _no_entries(p)
            return
        if not grad.is_sparse:
            raise RuntimeError(f"Expected variable to have sparse gradient. (DDP: parameter {name} belongs to a "
                               "module built with sparse=True, but its gradient is dense)")
        factor = None if self._comm_hook is not None else (self._pre_divisor() or self._world)
        with torch.no_grad():
            bucket.buffer = grad / factor if factor not in (None, 1) else grad

    def _launch_ready_buckets(self) -> None:
        while self._next_bucket < len(self._buckets) and self._buckets[self._next_bucket].pending == 0:
            bucket = self._buckets[self._next_bucket]
            self._next_bucket += 1
            if self._comm_hook is None:
                bucket.work = self._issue_all_reduce(bucket.buffer, self._bucket_op())
            else:
                bucket.future = self._run_hook(GradBucket(bucket.index, bucket.buffer, bucket.params,
                                                          bucket.offsets, bucket.index == len(self._buckets) - 1))
        if self._next_bucket == len(self._buckets):
            if self._tracks_used() and self._used_work is None:
                self._used_work = self._issue_all_reduce(self._locally_used, ReduceOp.SUM)
            # As PyTorch's reducer: the end of backward is awaited once the last bucket is
            # out, in the backward pass running now. Queued at the first hook instead, it
            # ran at the end of a reentrant checkpoint's inner backward, where that hook
            # fired, before the buckets of the parameters outside it were ready.
            # (_DDPSink queues it on the outermost backward at once.)
            self.queue_finalize()

    def _issue_all_reduce(self, tensor: torch.Tensor, op: ReduceOp):
        """All-reduce ``tensor`` (a contiguous flat bucket), to be waited on at the end of
        backward; ``async_op=True`` only where the backend runs it beside backward (see
        the module docstring)."""
        if tensor.is_sparse:  # gathered and summed now, outside the backend's queue; SUM, the only
            # reduction of sparse tensors: _take_sparse divided the gradient first
            return sparse_all_reduce(self._group, tensor, ReduceOp.SUM, async_op=True)
        backend = self._group.backend
        return backend.allreduce([torch.view_as_real(tensor) if tensor.is_complex() else tensor], op,
                                 async_op=getattr(backend, "async_overlaps_compute", False))

    def _tracks_used(self) -> bool:
        return self._find_unused or (self._static and not self._static_done)

    def _run_hook(self, grad_bucket: GradBucket) -> torch.futures.Future:
        future = self._comm_hook(self._comm_state, grad_bucket)
        if not isinstance(future, torch._C.Future):  # base of torch.futures.Future and of .then() results
            raise RuntimeError(f"callback must return a torch.futures.Future object, but got {type(future)}")
        return future

    def _finalize_backward(self) -> None:
        """Runs when backward ends: wait for every bucket, write the averaged gradients to ``.grad``."""
        if not self._expect_hooks:
            return
        if self._static and not self._static_done:
            self._delayed_reduce()
        elif self._find_unused:
            self._mark_unused_ready()  # in case no hook fired at all
        if self._next_bucket < len(self._buckets):
            logger.debug("reducer: backward ended with %d of %d buckets reduced", self._next_bucket,
                         len(self._buckets))
            return  # some parameter got no gradient: the next forward raises
        try:
            self._collect()
        except BaseException:
            # A comm hook's future failed (or the group broke). As in PyTorch, the error is
            # this iteration's: the next one starts afresh, once the buckets' other ops,
            # which write into the buckets, have finished.
            self._drain()
            raise
        finally:
            self._expect_hooks = False
            self._require_finalize = False
        self.num_backward += 1
        if self._static and not self._static_done:
            self._static_done = True
            self._counts = [max(c, 0) for c in self._counts]
        if self._should_rebuild() and self._rebuild_order is None:
            seen = set(self._arrival)
            self._rebuild_order = self._arrival + [i for i in reversed(range(len(self._params))) if i not in seen]

    def _collect(self) -> None:
        """Wait for every bucket and write the reduced gradients to ``.grad``."""
        if self._used_work is None:
            for bucket in self._buckets:  # write each bucket back while the next ones are in flight
                self._wait_bucket(bucket)
                self._write_back(bucket, self._global_used)
            return
        # which gradients to write depends on the used-parameter bitmap, reduced last
        for bucket in self._buckets:
            self._wait_bucket(bucket)
        self._used_work.wait()
        used = [c > 0 for c in self._locally_used.tolist()]
        self._locally_used.zero_()  # the next count starts after this reduction (no_sync ones too)
        if self._static:
            self._global_used = used
        for bucket in self._buckets:
            self._write_back(bucket, used)

    def _drain(self) -> None:
        """Wait out every op of this iteration, whatever it raises (the caller reports the first error)."""
        pending = [bucket.work or bucket.future for bucket in self._buckets] + [self._used_work]
        for item in pending:
            if item is not None:
                try:
                    item.wait()
                except Exception:  # noqa: BLE001 - the same failure, or one that follows from it
                    pass
        self._locally_used.zero_()

    def _delayed_reduce(self) -> None:
        """Static graph, first iteration: reduce every bucket now that the hook counts are known
        (which parameters were used, ``_locally_used``, the hooks recorded)."""
        self._first_hook_seen = True
        for bucket in self._buckets:
            for index in bucket.param_indices:
                self._mark_ready(index, used=self._counts[index] > 0)

    def _wait_bucket(self, bucket: Bucket) -> None:
        if bucket.work is not None:
            bucket.work.wait()
            return
        value = bucket.future.wait()
        result = value[0] if isinstance(value, (list, tuple)) else value
        if bucket.sparse and isinstance(result, torch.Tensor) and result.shape == bucket.buffer.shape:
            bucket.buffer = result  # sparse: the hook's tensor is the new gradient
            return
        # A longer tensor gives its leading elements, as PyTorch's reducer takes it.
        if not isinstance(result, torch.Tensor) or result.numel() < bucket.buffer.numel():
            raise RuntimeError(
                f"DDP communication hook: the future of bucket {bucket.index} must hold a tensor of "
                f"{bucket.buffer.numel()} elements (or a list whose first element is one), got {value!r:.200}")
        if result.data_ptr() != bucket.buffer.data_ptr():
            bucket.buffer.copy_(result.reshape(-1)[:bucket.buffer.numel()])

    def _write_back(self, bucket: Bucket, used: list[bool] | None) -> None:
        """Make ``.grad`` of the bucket's parameters hold the reduced gradients."""
        if bucket.in_grad:
            return  # reduced in place: .grad holds the average already
        if bucket.sparse:
            if used is None or used[bucket.param_indices[0]]:
                self._set_grad(bucket.params[0], bucket.buffer)
            return
        as_view = self._config.gradient_as_bucket_view
        with torch.no_grad():
            for p, index, view in zip(bucket.params, bucket.param_indices, bucket.views):
                if used is not None and not used[index]:
                    continue  # unused on every rank: the gradient stays as it was (None)
                grad = self._grad(p)
                if as_view:
                    if grad is None or grad.data_ptr() != view.data_ptr():
                        self._set_grad(p, view)
                elif grad is None or grad.is_sparse:
                    self._set_grad(p, view.clone())
                else:
                    grad.copy_(view)

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s gradient in this backward: ``.grad``, or the distributed autograd context's."""
        return p.grad if self._context is None else self._context.gradient(p)

    def _set_grad(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        if self._context is None:
            p.grad = grad
        else:
            self._context.set_gradient(p, grad)

    # -- introspection and teardown -----------------------------------------------------------
    def logging_data(self) -> dict:
        return {
            "num_buckets": len(self._buckets),
            "bucket_sizes": [b.nbytes for b in self._buckets],
            "solo_buckets": [b.index for b in self._buckets if b.solo],
            "bucket_indices": self.bucket_indices(),
            "has_rebuilt_buckets": self._has_rebuilt,
            "num_iterations": self.num_iterations,
            "num_backward": self.num_backward,
            "comm_hook": getattr(self._comm_hook, "__qualname__", None),
        }

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __del__(self) -> None:
        self.remove_hooks()
