"""``fully_shard`` and ``FSDPModule``: turn a module's parameters into sharded DTensors and wire up the hooks.

``fully_shard(module)`` makes one parameter group of the parameters of
``module`` that no earlier ``fully_shard`` call on a submodule took (so it is
applied bottom-up: blocks first, the root last), shards each parameter over
the mesh's shard dimension (along dim 0, or the dim ``shard_placement_fn``
picks; a parameter that tensor parallelism made a DTensor is sharded within its
TP-local block, see ``_param.py``), registers the shards on the module as
``nn.Parameter(DTensor)``, and changes the module's class to ``FSDP<Class>``, a
subclass of both :class:`FSDPModule` and the original class.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any, Callable, NoReturn

import torch
import torch.nn as nn

from ..device_mesh import DeviceMesh
from ._api import AllGather, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy, ReduceScatter
from ._dtensor import Shard
from ._mesh_info import MeshInfo, default_mesh, mesh_info_of
from ._param import FSDPParam, ParamSlot
from ._param_group import FSDPParamGroup
from ._state import FSDPState, state_of

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method", "share_comm_ctx"]

logger = logging.getLogger(__name__)

_FSDP_CLASSES: dict[type, type] = {}


def fully_shard(module: nn.Module | list[nn.Module], *, mesh: DeviceMesh | None = None,
                reshard_after_forward: bool | int | None = None,
                shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy = OffloadPolicy(),
                ignored_params: set[nn.Parameter] | None = None,
                dp_mesh_dims: DataParallelMeshDims | None = None) -> Any:
    """Shard ``module``'s parameters over ``mesh`` (default: 1-D over the world) and gather them around its forward
    and backward; see the module docstring. A list of modules makes one group communicated together. Returns the
    module (or the list), now ``FSDPModule`` instance(s). ``offload_policy`` is accepted and has no effect: on a
    CPU mesh the sharded parameters and gradients are on the host already. With ``dp_mesh_dims`` ``mesh`` is the full
    SPMD mesh the parameters already live on as DTensors, and ``dp_mesh_dims`` names its data-parallel dims
    (``_mesh_info``)."""
    modules = tuple(module) if isinstance(module, list) else (module,)
    if not modules:
        raise ValueError("fully_shard: got an empty list of modules; pass a module or a non-empty list of modules")
    for mod in modules:
        _check_module(mod)
    mesh = mesh or default_mesh()
    mesh_info = mesh_info_of(mesh, dp_mesh_dims)
    auto = reshard_after_forward is None
    if mesh_info.shard_mesh_dim is None:  # replicate-only (DDP): nothing to reshard to, as in PyTorch
        auto, reshard = False, False
    else:
        reshard = True if auto else _check_reshard_after_forward(reshard_after_forward, mesh_info)
    post_forward_mesh_info = None
    if not isinstance(reshard, bool):  # an int k: between forward and backward, shards over groups of k ranks
        post_forward_mesh = DeviceMesh(mesh.device_type, mesh.mesh.view(-1, reshard))
        post_forward_mesh_info = MeshInfo(post_forward_mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    managed = _managed_modules(modules)
    params = _managed_params(managed, ignored_params or set())
    names = _param_names(modules, params)
    dims = [_shard_dim(param, names[param], shard_placement_fn) for param in params]  # checked before any change

    state = FSDPState(modules, mp_policy, auto)
    if params:
        fsdp_params = [FSDPParam(param, _slots(param, managed), mesh_info, dim, mp_policy.param_dtype,
                                 mp_policy.reduce_dtype, names[param]) for param, dim in zip(params, dims)]
        _check_uniform_dtypes(fsdp_params)
        state.param_group = FSDPParamGroup(fsdp_params, modules, mesh_info, bool(reshard), post_forward_mesh_info)
    for mod in managed:
        mod._is_fsdp_managed_module = True
        mod._fsdp_use_orig_params = True
    for mod in modules:
        cls = type(mod)
        fsdp_cls = _FSDP_CLASSES.get(cls)
        if fsdp_cls is None:
            fsdp_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__deepcopy__": _no_deepcopy})
            _FSDP_CLASSES[cls] = fsdp_cls
        mod.__class__ = fsdp_cls
    return module


def _no_deepcopy(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError("FSDP does not support deepcopy. Please use state dict for serialization.")


# -- argument checks and discovery ---------------------------------------------------------------------------


def _check_module(module: nn.Module) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard expects an nn.Module or a list of them, got {type(module).__name__}")
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward:
        raise ValueError(f"fully_shard does not support containers that do not implement forward: {module}")
    if state_of(module) is not None:
        raise AssertionError(f"Each distinct composable distributed API can only be applied to a module once. "
                             f"fully_shard has already been applied to {type(module).__name__}")


def _check_reshard_after_forward(value: Any, mesh_info: MeshInfo) -> bool | int:
    """A bool, or an int dividing the shard group size (1 means False, the size means True), as PyTorch checks."""
    if not isinstance(value, (bool, int)):
        raise ValueError("reshard_after_forward should be a bool or an int representing the group size to reshard "
                         f"to, not {value}")
    if isinstance(value, bool):
        return value
    if mesh_info.is_spmd:
        raise NotImplementedError("reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims)")
    size = mesh_info.shard_size
    if value < 1 or value > size or size % value != 0:
        raise ValueError(f"If passing reshard_after_forward as an int, it should be a factor of {size}, not {value}")
    if value == 1:
        logger.warning("reshard_after_forward=1 (int) means resharding parameters to world size 1, instead of "
                       "reshard_after_forward=True (bool)")
        return False
    return True if value == size else value


def _managed_modules(roots: tuple[nn.Module, ...]) -> list[nn.Module]:
    """The modules this call manages: the roots and their descendants, stopping at earlier ``fully_shard`` ones."""
    found: list[nn.Module] = []
    seen: set[nn.Module] = set()

    def visit(module: nn.Module) -> None:
        if module in seen or (module not in roots and state_of(module) is not None):
            return
        seen.add(module)
        for child in module.children():
            visit(child)
        found.append(module)

    for root in roots:
        visit(root)
    return found


def _managed_params(modules: list[nn.Module], ignored: set[nn.Parameter]) -> list[nn.Parameter]:
    params: list[nn.Parameter] = []
    seen: set[int] = set()
    for module in modules:
        for name, param in module.named_parameters(recurse=False):
            if param in ignored or id(param) in seen:
                continue
            if param.dim() == 0:
                raise ValueError(f"fully_shard doesn't support scalar parameters. Change {name} to a 1D tensor with "
                                 "numel equal to 1.")
            seen.add(id(param))
            params.append(param)
    return params


def _slots(param: nn.Parameter, modules: list[nn.Module]) -> list[ParamSlot]:
    return [ParamSlot(module, name) for module in modules for name, p in module._parameters.items() if p is param]


def _param_names(roots: tuple[nn.Module, ...], params: list[nn.Parameter]) -> dict[nn.Parameter, str]:
    wanted = set(map(id, params))
    names: dict[nn.Parameter, str] = {}
    for root in roots:
        for name, param in root.named_parameters(remove_duplicate=False):
            if id(param) in wanted and param not in names:
                names[param] = name
    return names


def _shard_dim(param: nn.Parameter, name: str, shard_placement_fn: Callable | None) -> int:
    placement = shard_placement_fn(param) if shard_placement_fn is not None else None
    if placement is None:
        return 0
    if not isinstance(placement, Shard):
        raise NotImplementedError(f"fully_shard: shard_placement_fn returned {placement!r} for {name}; torchdist "
                                  "supports None or Shard(dim) (not a per-parameter mesh)")
    dim = placement.dim
    if not -param.dim() <= dim < param.dim():
        raise ValueError(f"fully_shard: shard_placement_fn returned Shard({dim}) for {name} of shape "
                         f"{tuple(param.shape)}; the dim must be in [-{param.dim()}, {param.dim()})")
    return dim % param.dim()


def _check_uniform_dtypes(params: list[FSDPParam]) -> None:
    trainable = [p for p in params if p.requires_grad]
    orig = {p.orig_dtype for p in trainable}
    if len(orig) > 1:
        raise AssertionError(f"FSDP expects uniform original parameter dtype but got {orig}")
    reduce = {p.reduce_dtype for p in trainable}
    if len(reduce) > 1:
        raise AssertionError(f"FSDP expects uniform reduce dtype but got {reduce}")


# -- FSDPModule ------------------------------------------------------------------------------------------------


class UnshardHandle:
    """What ``FSDPModule.unshard(async_op=True)`` returns: ``wait()`` makes the unsharded parameters usable."""

    def wait(self) -> None:
        return


class _UnshardHandle(UnshardHandle):
    def __init__(self, groups: list[FSDPParamGroup]) -> None:
        self._groups = groups

    def wait(self) -> None:
        for group in self._groups:
            group.wait_for_unshard()
        self._groups = []


class FSDPModule:
    """The mixin ``fully_shard`` adds to a module's class: control over gathering, resharding and gradient sync."""

    _orig_cls_mro_index: int = 2  # (FSDP<Class>, FSDPModule, Class, ...)

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # containers build new instances of their own class (Sequential slicing): make plain ones
        orig_cls = cls.__mro__[cls._orig_cls_mro_index]
        self = orig_cls.__new__(orig_cls, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def _get_fsdp_state(self) -> FSDPState:
        state = state_of(self)  # type: ignore[arg-type]
        if state is None:
            raise AssertionError(f"No FSDP state found on {type(self).__name__}")
        return state

    def _fsdp_modules(self, recurse: bool) -> list[FSDPModule]:
        modules = list(self.modules()) if recurse else [self]  # type: ignore[attr-defined]
        return [m for m in modules if isinstance(m, FSDPModule)]

    def _groups(self, recurse: bool = False) -> list[FSDPParamGroup]:
        return [g for m in self._fsdp_modules(recurse) for g in m._get_fsdp_state().groups]

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones (not recursive)."""
        for group in self._groups():
            group.reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather the parameters (not recursive); with ``async_op`` return a handle to ``wait()`` on."""
        groups = self._groups()
        for group in groups:
            group.unshard(async_op=async_op)
        handle = _UnshardHandle(groups)
        if async_op:
            return handle
        handle.wait()
        return None

    def reset_iter_state(self) -> None:
        """Recover after a forward or backward raised: reshard everything and drop the step's gradients."""
        self._get_fsdp_state().reset_iter_state()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the step's last one (then per-step state is cleared after it)."""
        self._get_fsdp_state().ctx.is_last_backward = is_last_backward

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Whether backward reduces gradients (False: accumulate unsharded gradients locally, FSDP1's no_sync)."""
        for group in self._groups(recurse):
            group.reduce_grads = requires_gradient_sync
            group.all_reduce_grads = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: whether backward all-reduces over the replicate group (False: reduce-scatter only, accumulate)."""
        for group in self._groups(recurse):
            group.all_reduce_grads = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` at run time (e.g. False for evaluation)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        for module in self._fsdp_modules(recurse):
            state = module._get_fsdp_state()
            state.auto_reshard_after_forward = False
            for group in state.groups:
                if group.mesh_info.shard_mesh_dim is None:
                    raise AssertionError("set_reshard_after_forward: a replicate-only (DDP) fully_shard group has no "
                                         "shards to reshard to")
                group.reshard_after_forward = reshard_after_forward
                group.post_forward_mesh_info = None

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether backward frees the unsharded parameters (False saves the next forward's all-gather)."""
        for group in self._groups(recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Start these modules' all-gathers right after this module's, in forward."""
        _check_fsdp_modules(modules)
        self._get_fsdp_state().forward_prefetch = [m._get_fsdp_state() for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Start these modules' all-gathers in this module's pre-backward (replaces the default prefetch)."""
        _check_fsdp_modules(modules)
        self._get_fsdp_state().backward_prefetch = [m._get_fsdp_state() for m in modules]

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """Call ``hook(reduce_output)`` on the reduced flat gradient shard (after the HSDP all-reduce, if any)."""
        for group in self._groups():
            if stream is not None and group.mesh_info.replicate_group is not None:
                raise ValueError("stream cannot be set when using native HSDP")
            group.all_reduce_hook = hook

    def set_post_optim_event(self, event: Any) -> None:
        """Accepted for compatibility: CPU collectives run in program order, so there is no stream to wait on."""

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated spelling of :meth:`set_gradient_divide_factor`."""
        warnings.warn("Use `set_gradient_divide_factor` instead", FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of averaging over the data-parallel ranks."""
        for group in self._groups():
            group.gradient_divide_factor = factor

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with SUM only, dividing separately (instead of an AVG or PREMUL_SUM collective)."""
        for group in self._groups():
            group.force_sum_reduction_for_comms = enable

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Reduce zeros for parameters without a gradient, so ranks with different control flow still match."""
        for group in self._groups(recurse):
            group.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """A no-op once checked: CPU reduce-scatters complete before the next one starts, so one buffer is used."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """A no-op: on CPU, all-gather and reduce-scatter never overlap here, so one group serves both."""

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward needs this module's parameters (False for e.g. an embedding whose grads come anyway)."""
        for group in self._groups():
            group.unshard_in_backward = unshard_in_backward

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted: torchdist's CPU process groups have no special allocator."""

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        raise NotImplementedError("set_symm_mem_for_comm: symmetric-memory all-gathers need NCCL on GPUs; "
                                  "torchdist's FSDP runs on CPU")

    def set_custom_all_gather(self, comm: AllGather) -> None:
        """All-gather this module's parameters with ``comm`` (its ``allocate`` gives the output buffer)."""
        for group in self._groups():
            group.all_gather_comm = comm

    def set_custom_reduce_scatter(self, comm: ReduceScatter) -> None:
        """Reduce-scatter this module's gradients with ``comm`` (its ``allocate`` gives the output buffer)."""
        for group in self._groups():
            group.reduce_scatter_comm = comm

    def _set_unshard_async_op(self, async_op: bool) -> None:
        for group in self._groups():
            group.unshard_async_op = async_op


def _check_fsdp_modules(modules: Any) -> None:
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects FSDPModule but got {type(module)}: {module}")


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run FSDP's pre/post-forward around ``module.method_name`` too (e.g. ``generate``); no-op off FSDP."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    orig = getattr(module, method_name)

    @functools.wraps(orig)
    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = self._get_fsdp_state()
        args, kwargs = state._pre_forward(self, args, kwargs)
        out = orig(*args, **kwargs)
        return state._post_forward(self, args, out)

    setattr(module, method_name, wrapped.__get__(module, type(module)))


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Share communication streams between FSDP roots: on CPU there are none, so this only checks its argument."""
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects list of FSDPModules but got {module}")
