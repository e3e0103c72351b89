"""``DistributedDataParallel``: data parallelism by gradient all-reduce during backward.

The public front of DDP, with ``torch.nn.parallel.DistributedDataParallel``'s
constructor, methods and errors. What it does on each call (Li et al., "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020,
Algorithm 1):

- construction: check that every rank has the same parameter shapes, broadcast
  rank 0's parameters and buffers, build the :class:`~torchdist._ddp.reducer.Reducer`
  (buckets and autograd hooks);
- forward: rebuild the buckets once after the first iteration, broadcast buffers
  from rank 0 (``broadcast_buffers``), run the module, and tell the reducer
  whether this forward's backward reduces (not under ``no_sync()``);
- backward: the reducer's hooks all-reduce bucket after bucket while backward
  runs; ``.grad`` holds the average over ranks when ``backward()`` returns.

Uneven inputs: DDP is a :class:`~torchdist.algorithms.join.Joinable`; under
``model.join()`` a rank that ran out of data shadows the others' collectives
(:class:`_DDPJoinHook`).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import warnings
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..._c10d.collectives import all_reduce
from ..._c10d.world import WORLD
from ..._ddp.bucket import GradBucket
from ..._ddp.config import DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_BYTES, DDPConfig
from ..._ddp.reducer import Reducer
from ..._ddp.sync import broadcast_coalesced, find_common_rank, verify_param_shapes
from ..._process_group.process_group import ProcessGroup
from ...algorithms.join import Join, JoinHook, Joinable

__all__ = ["DistributedDataParallel"]

logger = logging.getLogger(__name__)


class _DDPSink(torch.autograd.Function):
    """Identity on the forward's outputs whose backward runs first in backward.

    It queues the reducer's finalize callback on the *outermost* backward pass, so
    that it runs after every hook, including those fired by nested (reentrant
    checkpointing) backward passes.
    """

    @staticmethod
    def forward(ctx, reducer_ref, *tensors):
        ctx.reducer_ref = reducer_ref
        ctx.set_materialize_grads(False)
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        # A weak reference, unless torch.compile traced the forward: Dynamo hands
        # ``apply`` the object the reference points to.
        ref = ctx.reducer_ref
        reducer = ref() if isinstance(ref, weakref.ref) else ref
        if reducer is not None:
            reducer.queue_finalize()
        return (None, *grads)


class _DDPJoinHook(JoinHook):
    """Shadows one DDP iteration (forward's and backward's collectives) on a joined rank."""

    def __init__(self, ddp: "DistributedDataParallel", divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size
        # A rank that joins before any forward of its own shadows with this setting too.
        ddp.reducer.set_forward_pass_work_handle(None, divide_by_initial_world_size)

    def main_hook(self) -> None:
        ddp = self.ddp
        ddp.reducer.rebuild_buckets()
        ddp._check_and_sync_module_buffers()
        should_sync = ddp._check_global_requires_backward_grad_sync(is_joined_rank=True)
        ddp.require_forward_param_sync = should_sync
        if not should_sync:
            return
        ddp.reducer.match_all_reduce_for_joined()
        ddp.reducer.push_all_rebuilt_params()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp._sync_final_model(is_last_joiner)


def _check_comm_hook(hook: Callable) -> None:
    if not callable(hook):
        raise TypeError("Communication hook must be callable.")
    try:
        sig = inspect.signature(hook)
    except (TypeError, ValueError):
        return
    bucket = sig.parameters.get("bucket")
    if bucket is not None and bucket.annotation is not inspect.Parameter.empty:
        ann = bucket.annotation
        if ann is not GradBucket and not (isinstance(ann, str) and ann.split(".")[-1] == "GradBucket"):
            raise ValueError("Communication hook: bucket annotation should be dist.GradBucket.")
    ret = sig.return_annotation
    if ret is not inspect.Signature.empty:
        ok = ret == torch.futures.Future[torch.Tensor] or (
            isinstance(ret, str) and ret.replace(" ", "") in ("torch.futures.Future[torch.Tensor]", "Future[Tensor]",
                                                              "Future[torch.Tensor]"))
        if not ok:
            raise ValueError("Communication hook: return annotation should be torch.futures.Future[torch.Tensor].")


def _reduced_parameters(module: torch.nn.Module, ignore: set[str]) -> tuple[list[str], list[torch.nn.Parameter]]:
    """Names and parameters whose gradients DDP averages: those requiring grad, not ignored."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in ignore]
    return [n for n, _ in named], [p for _, p in named]


def _expect_sparse(module: torch.nn.Module, params: list[torch.nn.Parameter]) -> list[bool]:
    """Which of ``params`` get sparse gradients: those of an ``Embedding`` or
    ``EmbeddingBag`` built with ``sparse=True`` (PyTorch's rule)."""
    sparse = {id(p) for m in module.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
              and m.sparse for p in m.parameters(recurse=False)}
    return [id(p) in sparse for p in params]


def _find_tensors(obj) -> list[torch.Tensor]:
    """The tensors in a forward's output, as PyTorch's DDP finds them: inside lists,
    tuples, dicts and dataclasses (which pytree does not enter)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _find_tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _find_tensors(item)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in _find_tensors(getattr(obj, f.name))]
    return []


class DistributedDataParallel(torch.nn.Module, Joinable):
    """Replicates ``module`` on every rank and averages its gradients during backward.

    Arguments are PyTorch's. CPU modules only: ``device_ids`` and
    ``output_device`` must be None or empty (as PyTorch requires for CPU modules).
    ``forward_sync_buffers`` (2.13) overrides ``broadcast_buffers`` when given;
    passing ``broadcast_buffers`` warns, as in PyTorch 2.13, and ``False`` also
    skips the buffers in the construction broadcast.
    ``mixed_precision``, ``delay_all_reduce_named_params``/``param_to_hook_all_reduce``
    and ``skip_all_reduce_unused_params`` are not supported and raise ``ValueError``
    (see docs/design/ddp.md); ``batched_grad_copy`` is accepted and has no effect.
    """

    def __init__(self, module: torch.nn.Module, device_ids: list[int | torch.device] | None = None,
                 output_device: int | torch.device | None = None, dim: int = 0,
                 broadcast_buffers: bool | None = None, init_sync: bool = True,
                 process_group: ProcessGroup | None = None,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 delay_all_reduce_named_params=None, param_to_hook_all_reduce=None, mixed_precision=None,
                 device_mesh=None, skip_all_reduce_unused_params: bool = False,
                 bucket_cap_mb_list: list[float] | None = None,
                 batched_grad_copy: bool = False, forward_sync_buffers: bool | None = None) -> None:
        torch.nn.Module.__init__(self)
        Joinable.__init__(self)
        devices = {p.device for p in module.parameters()}
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError("device_ids can only be None or contain a single element.")
        if device_ids or output_device:  # PyTorch tests truth: device_ids=[] and output_device=0 pass on CPU
            raise ValueError(
                "DistributedDataParallel device_ids and output_device arguments only work with single-device/"
                f"multiple-device GPU modules or CPU modules, but got device_ids {device_ids}, output_device "
                f"{output_device}, and module parameters {devices}.")
        if any(d.type != "cpu" for d in devices):
            raise ValueError(f"torchdist's DistributedDataParallel runs CPU modules only; module parameters are on "
                             f"{sorted(map(str, devices))}")
        for name, value in (("mixed_precision", mixed_precision),
                            ("delay_all_reduce_named_params", delay_all_reduce_named_params),
                            ("param_to_hook_all_reduce", param_to_hook_all_reduce)):
            if value is not None:
                raise ValueError(f"DistributedDataParallel: {name} is not supported by torchdist "
                                 "(see docs/design/ddp.md); pass None")
        if skip_all_reduce_unused_params:
            raise ValueError("DistributedDataParallel: skip_all_reduce_unused_params is not supported by torchdist "
                             "(see docs/design/ddp.md); pass False")
        if check_reduction:
            warnings.warn("The `check_reduction` argument in `DistributedDataParallel` module is deprecated. Please "
                          "avoid using it.", FutureWarning, stacklevel=2)
        if process_group is not None and device_mesh is not None:
            raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
        if device_mesh is not None:
            if device_mesh.ndim != 1:
                raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
            process_group = device_mesh.get_group(mesh_dim=0)
        self.process_group = process_group if process_group is not None else WORLD.require_default()
        if broadcast_buffers is not None:
            if forward_sync_buffers is not None:
                warnings.warn("Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
                              "`broadcast_buffers` is deprecated and its value is ignored when "
                              "`forward_sync_buffers` is provided.", FutureWarning, stacklevel=2)
            else:
                warnings.warn("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. IMPORTANT: "
                              "unlike `broadcast_buffers=False`, `forward_sync_buffers=False` still syncs buffers at "
                              "init. If you rely on buffers NOT being synced at init (e.g. rank-local buffers), keep "
                              "using `broadcast_buffers=False` until `init_sync_buffers` is available.",
                              FutureWarning, stacklevel=2)
        # forward_sync_buffers: buffers broadcast before each forward (and by join's final
        # sync); the deprecated broadcast_buffers=False also skips them at construction.
        if forward_sync_buffers is not None:
            broadcast_buffers, init_sync_buffers = forward_sync_buffers, True
        else:
            broadcast_buffers = init_sync_buffers = True if broadcast_buffers is None else broadcast_buffers
        self.module = module
        self.device_ids = None
        self.output_device = None
        self.dim = dim
        self.device = torch.device("cpu")
        self.static_graph = static_graph
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.broadcast_buffers = broadcast_buffers
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._divide_by_initial_world_size = True
        self._config = DDPConfig(
            bucket_cap_mb=DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb,
            first_bucket_bytes=DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else None,
            bucket_cap_mb_list=tuple(bucket_cap_mb_list) if bucket_cap_mb_list is not None else None,
            find_unused_parameters=find_unused_parameters, gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph)
        self.bucket_bytes_cap = self._config.bucket_bytes_cap

        ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self.parameters_to_ignore = ignore
        names, params = _reduced_parameters(module, ignore)
        if not params:
            raise RuntimeError("DistributedDataParallel is not needed when a module doesn't have any parameter "
                               "that requires a gradient.")
        self._module_params = params
        self._module_param_names = names
        self.modules_buffers = [b for n, b in module.named_buffers() if n not in ignore]
        verify_param_shapes(params, names, self.process_group)
        if init_sync:
            self._sync_module_states(authoritative_rank=0, buffers=init_sync_buffers)
        self.reducer = Reducer(params, names, self.process_group, self._config, _expect_sparse(module, params))
        self._has_rebuilt_buckets = False
        if static_graph:
            self._warn_if_find_unused_with_static_graph()

    # -- pickling (torch.save, copy.deepcopy), as PyTorch's DDP ---------------------------
    def __getstate__(self) -> dict[str, Any]:
        """Everything but the process group and the reducer (sockets, hooks): a copy is
        rebuilt on the default group by ``__setstate__``, without a registered comm hook."""
        if self.process_group is not WORLD.default_pg:
            raise RuntimeError("DDP Pickling/Unpickling are only supported when using DDP with the default process "
                               "group. That is, when you have called init_process_group and have not passed "
                               "process_group argument to DDP constructor")
        state = dict(self.__dict__)
        del state["process_group"], state["reducer"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.process_group = WORLD.require_default()
        super().__setstate__(state)
        self._module_param_names, self._module_params = _reduced_parameters(self.module, self.parameters_to_ignore)
        self.reducer = Reducer(self._module_params, self._module_param_names, self.process_group, self._config,
                               _expect_sparse(self.module, self._module_params))

    # -- forward -----------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        with torch.autograd.profiler.record_function("DistributedDataParallel.forward"):
            self._pre_forward()
            output = self.module(*inputs, **kwargs)
            return self._post_forward(output)

    def _pre_forward(self) -> None:
        grad_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if grad_sync:
            self.reducer.prepare_for_forward()
        # Inside a join: the count of ranks still active (None outside one, which drops the
        # last join's count: every rank is active again).
        work = Join.notify_join_context(self)
        self.reducer.set_forward_pass_work_handle(work, self._divide_by_initial_world_size)
        if torch.is_grad_enabled() and self.reducer.rebuild_buckets():
            self._has_rebuilt_buckets = True
        if self._check_sync_bufs_pre_fwd():
            self._sync_buffers()
        if self._join_config.enable:
            self._check_global_requires_backward_grad_sync(is_joined_rank=False)

    def _post_forward(self, output):
        if not torch.is_grad_enabled():  # nothing to reduce, so the next forward syncs no buffers
            self.require_forward_param_sync = False
            return output
        if not self.require_backward_grad_sync:
            self.require_forward_param_sync = False
            self.reducer.disable_hooks()
            return output
        self.require_forward_param_sync = True
        self.reducer.prepare_for_backward(
            [t for t in _find_tensors(output) if t.requires_grad] if self.find_unused_parameters else [])
        flat, spec = tree_flatten(output)
        tensors = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors or not (self.find_unused_parameters or self.static_graph):
            return output
        passed = iter(_DDPSink.apply(weakref.ref(self.reducer), *tensors))
        flat = [next(passed) if isinstance(t, torch.Tensor) and t.requires_grad else t for t in flat]
        return tree_unflatten(flat, spec)

    # -- buffers and replica sync ----------------------------------------------------------------
    def will_sync_module_buffers(self) -> bool:
        return self.require_forward_param_sync and self.broadcast_buffers and len(self.modules_buffers) > 0

    def _check_sync_bufs_pre_fwd(self) -> bool:
        return self.will_sync_module_buffers()

    def _sync_buffers(self) -> None:
        if self._join_config.enable:
            rank = find_common_rank(self.process_group, True)
        else:
            rank = 0
        self._sync_module_buffers(rank)

    def _check_and_sync_module_buffers(self) -> None:
        """On a joined rank: match the buffer broadcast of the others' forward."""
        if self._check_sync_bufs_pre_fwd():
            self._sync_module_buffers(find_common_rank(self.process_group, False))

    def _sync_module_buffers(self, authoritative_rank: int) -> None:
        self.modules_buffers = [b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]
        broadcast_coalesced(self.modules_buffers, authoritative_rank, self.process_group)

    def _sync_module_states(self, authoritative_rank: int, buffers: bool) -> None:
        """Broadcast every parameter (trainable or not) and, if ``buffers``, every buffer
        (persistent or not), skipping ignored ones; shared tensors once."""
        named = list(self.module.named_parameters()) + (list(self.module.named_buffers()) if buffers else [])
        tensors = [t for n, t in named if n not in self.parameters_to_ignore]
        broadcast_coalesced(tensors, authoritative_rank, self.process_group)

    def _check_global_requires_backward_grad_sync(self, is_joined_rank: bool) -> bool:
        flag = torch.ones(1) if not is_joined_rank and self.require_backward_grad_sync else torch.zeros(1)
        work = all_reduce(flag, group=self.process_group, async_op=True)
        if is_joined_rank:
            work.wait()
            return bool(flag.item() > 0)
        return True

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        rank = find_common_rank(self.process_group, is_last_joiner)
        self._sync_module_states(authoritative_rank=rank, buffers=self.broadcast_buffers)

    # -- no_sync, join, hooks ---------------------------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside this context backward accumulates gradients locally; the next synced backward reduces them."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Context manager for ranks with different numbers of batches (see :class:`Join`)."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs) -> JoinHook:
        return _DDPJoinHook(self, divide_by_initial_world_size=kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self):
        return self.process_group

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Replace the bucket all-reduce by ``hook(state, bucket) -> Future`` (see ddp_comm_hooks)."""
        _check_comm_hook(hook)
        self.reducer.register_comm_hook(state, hook)

    def _register_builtin_comm_hook(self, comm_hook_type) -> None:
        from ...algorithms.ddp_comm_hooks import BuiltinCommHookType, DDPCommHookType, register_ddp_comm_hook
        if not isinstance(comm_hook_type, BuiltinCommHookType):
            raise TypeError("_register_builtin_comm_hook takes a torchdist.BuiltinCommHookType, "
                            f"got {comm_hook_type!r}")
        register_ddp_comm_hook(DDPCommHookType[comm_hook_type.name], self)

    # -- configuration and introspection --------------------------------------------------------
    def _set_static_graph(self) -> None:
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.")
            return
        self.reducer.set_static_graph()
        self.static_graph = True
        self._warn_if_find_unused_with_static_graph()

    def _warn_if_find_unused_with_static_graph(self) -> None:
        if self.find_unused_parameters:
            warnings.warn(
                "You passed find_unused_parameters=true to DistributedDataParallel, `_set_static_graph` will detect "
                "unused parameters automatically, so you do not need to set find_unused_parameters=true, just be "
                "sure these unused parameters will not change during training loop while calling "
                "`_set_static_graph`.", stacklevel=3)

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: torch.nn.Module, params_and_buffers_to_ignore) -> None:
        module._ddp_params_and_buffers_to_ignore = list(params_and_buffers_to_ignore)

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        return {
            "world_size": self.process_group.size(),
            "rank": self.process_group.rank(),
            "module_name": type(self.module).__name__,
            "bucket_cap_bytes": self.bucket_bytes_cap,
            "find_unused_parameters": int(self.find_unused_parameters),
            "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
            "static_graph": int(self.static_graph),
            "broadcast_buffers": int(self.broadcast_buffers),
            "num_parameter_tensors": len(self._module_params),
            "total_parameter_size_bytes": sum(p.nbytes for p in self._module_params),
            **self.reducer.logging_data(),
        }
