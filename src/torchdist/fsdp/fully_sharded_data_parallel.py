"""``FullyShardedDataParallel`` (FSDP1): a module wrapper whose parameters are one sharded flat tensor per unit.

The constructor wraps the submodules an ``auto_wrap_policy`` picks (each its own
unit, children first), then flattens and shards the parameters its own module
still holds (``_flat_param.FlatParamHandle``). ``_fsdp1_runtime`` says when a
unit gathers, frees and reduces; ``_fsdp1_state_dict`` how the state dicts and
``summon_full_params`` see whole parameters; ``_fsdp1_optim`` how optimizer
states are converted between the sharded and the per-parameter form.

Names follow PyTorch: the wrapped module is ``_fsdp_wrapped_module``, the flat
parameter ``_flat_param``; state dicts and ``summon_full_params`` strip the
``_fsdp_wrapped_module.`` prefixes.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, Callable, Generator, Iterable

import torch
import torch.nn as nn

from .._c10d.collectives import all_reduce, broadcast
from .._c10d.groups import get_global_rank
from .._c10d.world import WORLD
from .._process_group.process_group import ProcessGroup
from .._process_group.reduce_op import ReduceOp
from . import _fsdp1_optim, _fsdp1_state_dict
from ._flat_param import (FLAT_PARAM, FSDP_FLATTENED, FSDP_PREFIX, FSDP_WRAPPED_MODULE, FlatParameter,
                          FlatParamHandle, ParamInfo)
from ._fsdp1_runtime import TrainingState, lazy_init, post_backward, post_forward, pre_forward
from .api import (BackwardPrefetch, CPUOffload, FullOptimStateDictConfig, FullStateDictConfig, MixedPrecision,
                  ShardingStrategy, StateDictSettings, StateDictType)
from .wrap import _auto_wrap

__all__ = ["FullyShardedDataParallel"]

_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


class FullyShardedDataParallel(nn.Module):
    """Shard ``module``'s parameters across the data-parallel ranks (PyTorch's FSDP1 API, on CPU)."""

    def __init__(self, module: nn.Module, process_group: Any = None,
                 sharding_strategy: ShardingStrategy | None = None, cpu_offload: CPUOffload | None = None,
                 auto_wrap_policy: Callable | Any | None = None,
                 backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
                 mixed_precision: MixedPrecision | None = None, ignored_modules: Iterable[nn.Module] | None = None,
                 param_init_fn: Callable[[nn.Module], None] | None = None, device_id: Any = None,
                 sync_module_states: bool = False, forward_prefetch: bool = False, limit_all_gathers: bool = True,
                 use_orig_params: bool = False, ignored_states: Iterable[Any] | None = None,
                 device_mesh: Any = None) -> None:
        super().__init__()
        if isinstance(module, FullyShardedDataParallel) and auto_wrap_policy is not None:
            raise ValueError("FSDP does not support wrapping a module that is already FSDP with an auto_wrap_policy")
        _check_device(device_id, module)
        ignored_modules_set, ignored_params = _ignored(module, ignored_modules, ignored_states)
        strategy = sharding_strategy or ShardingStrategy.FULL_SHARD
        shard_group, replicate_group = _resolve_groups(process_group, device_mesh, strategy, auto_wrap_policy)
        if shard_group.size() * (replicate_group.size() if replicate_group is not None else 1) == 1 or (
                strategy in _HYBRID and shard_group.size() == 1 and replicate_group is None):
            if strategy != ShardingStrategy.NO_SHARD:
                warnings.warn(f"FSDP is switching to use `NO_SHARD` instead of {strategy} since the world size is 1.",
                              stacklevel=2)
            strategy = ShardingStrategy.NO_SHARD
        elif strategy == ShardingStrategy.NO_SHARD:
            warnings.warn("The `NO_SHARD` sharding strategy is deprecated. If having issues, please use "
                          "`DistributedDataParallel` instead.", FutureWarning, stacklevel=2)
        if mixed_precision is not None and isinstance(module, tuple(mixed_precision._module_classes_to_ignore)):
            mixed_precision = None  # e.g. BatchNorm runs in full precision, as in PyTorch
        self.process_group = shard_group
        self._inter_node_pg = replicate_group
        self.rank, self.world_size = shard_group.rank(), shard_group.size()
        self.sharding_strategy = strategy
        self.mixed_precision = mixed_precision
        self.cpu_offload = cpu_offload or CPUOffload()
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = forward_prefetch
        self.limit_all_gathers = limit_all_gathers
        self._use_orig_params = use_orig_params
        self._device_mesh = device_mesh
        self._ignored_modules = ignored_modules_set
        self._ignored_params = ignored_params
        self._ignored_buffer_ids = {id(b) for m in ignored_modules_set for b in m.buffers()}
        if auto_wrap_policy is not None:
            root_kwargs = dict(process_group=process_group, sharding_strategy=sharding_strategy,
                               cpu_offload=cpu_offload, backward_prefetch=backward_prefetch,
                               mixed_precision=mixed_precision, param_init_fn=param_init_fn, device_id=device_id,
                               sync_module_states=sync_module_states, forward_prefetch=forward_prefetch,
                               limit_all_gathers=limit_all_gathers, use_orig_params=use_orig_params,
                               ignored_states=ignored_params, device_mesh=device_mesh)
            if strategy in _HYBRID and device_mesh is None:  # every unit shares the same two groups
                root_kwargs["process_group"] = (shard_group, replicate_group)
            _auto_wrap(module, auto_wrap_policy, ignored_modules_set, ignored_params, root_kwargs,
                       FullyShardedDataParallel)
        _materialize(module, param_init_fn, ignored_modules_set)
        self._fsdp_wrapped_module = module
        infos = _collect_params(module, ignored_params)
        if sync_module_states:
            _sync_module_states(module, infos, shard_group, replicate_group, self._ignored_buffer_ids)
        self._handle: FlatParamHandle | None = None
        if infos:
            self._handle = FlatParamHandle(
                infos, shard_group, replicate_group,
                sharded=strategy != ShardingStrategy.NO_SHARD, use_orig_params=use_orig_params,
                mixed_precision=mixed_precision,
                keep_low_precision_grads=mixed_precision is not None and mixed_precision.keep_low_precision_grads)
            handle = self._handle
            if use_orig_params:
                handle.use_sharded_views()
            else:
                for info in infos:  # plain tensor attributes until the first forward points them at the flat
                    info.module._parameters.pop(info.name, None)
                    info.module.__dict__[info.name] = info.param.detach()
                module._parameters[FLAT_PARAM] = handle.flat
            handle.flat.register_post_accumulate_grad_hook(lambda _p, unit=self: post_backward(unit))
        self._is_root: bool | None = None
        self._all_units: list[FullyShardedDataParallel] = []
        self.training_state = TrainingState.IDLE
        self._sync_gradients = True
        self._ran_pre_backward = False
        self._callback_queued = False
        self._comm_hook: Callable | None = None
        self._comm_hook_state: Any = None
        self._state_dict_type = StateDictType.FULL_STATE_DICT
        self._state_dict_config = FullStateDictConfig()
        self._optim_state_dict_config = FullOptimStateDictConfig()
        _fsdp1_state_dict.register_hooks(self)

    # -- the wrapped module ------------------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    @property
    def _has_params(self) -> bool:
        return self._handle is not None

    @property
    def _flat_param(self) -> FlatParameter | None:
        return self._handle.flat if self._handle is not None else None

    def __getattr__(self, name: str) -> Any:
        """Attributes FSDP does not have come from the wrapped module."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == FSDP_WRAPPED_MODULE:
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: int) -> Any:
        """Indexing reaches into the wrapped module (e.g. an ``nn.Sequential``)."""
        return self._fsdp_wrapped_module.__getitem__(key)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Gather the unit's parameters, run the wrapped module, free them (FULL_SHARD) and hook backward."""
        args, kwargs = pre_forward(self, args, kwargs)
        return post_forward(self, self._fsdp_wrapped_module(*args, **kwargs))

    def _root(self) -> FullyShardedDataParallel:
        for unit in self._all_units or [self]:
            if unit._is_root:
                return unit
        return self

    def check_is_root(self) -> bool:
        """Whether this instance is the root (lazily decided at its first use)."""
        lazy_init(self)
        return bool(self._is_root)

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """The FSDP instances in ``module`` (itself included), pre-order; only the outermost with ``root_only``."""
        units = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        if not root_only:
            return units
        inner = {id(m) for u in units for m in u.modules() if m is not u and isinstance(m, FullyShardedDataParallel)}
        return [u for u in units if id(u) not in inner]

    def _reset_lazy_init(self) -> None:
        self._is_root = None

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """``nn.Module.apply`` with this unit's full parameters gathered (and written back) around ``fn``."""
        uninitialized = self._is_root is None
        self._assert_state(TrainingState.IDLE)
        with _fsdp1_state_dict.unshard_params([self], writeback=True, rank0_only=False, offload_to_cpu=False,
                                              with_grads=False):
            ret = super().apply(fn)
        if uninitialized and self._is_root:
            for unit in self._all_units:
                unit._reset_lazy_init()
        return ret

    def _assert_state(self, state: TrainingState | list[TrainingState]) -> None:
        states = [state] if isinstance(state, TrainingState) else state
        if self.training_state not in states:
            raise ValueError(f"expected to be in states {states} but current state is {self.training_state}")

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterable[tuple[str, nn.Parameter]]:
        """As ``nn.Module``'s, with the ``_fsdp_wrapped_module.`` prefixes removed inside ``summon_full_params``."""
        clean = self.training_state == TrainingState.SUMMON_FULL_PARAMS
        for name, param in super().named_parameters(*args, **kwargs):
            yield (name.replace(FSDP_PREFIX, "") if clean else name), param

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterable[tuple[str, torch.Tensor]]:
        clean = self.training_state == TrainingState.SUMMON_FULL_PARAMS
        for name, buf in super().named_buffers(*args, **kwargs):
            yield (name.replace(FSDP_PREFIX, "") if clean else name), buf

    # -- gradient synchronization ------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Accumulate unsharded, unreduced gradients (on the root); the first backward after it reduces them."""
        lazy_init(self)
        if not self._is_root:
            raise RuntimeError("`no_sync()` on inner FSDP instances is not supported. Please call `no_sync()` on "
                               "root FSDP module.")
        self._assert_state(TrainingState.IDLE)
        old = [(m, m._sync_gradients) for m in self.modules() if isinstance(m, FullyShardedDataParallel)]
        for unit, _ in old:
            unit._sync_gradients = False
        try:
            yield
        finally:
            for unit, flag in old:
                unit._sync_gradients = flag

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Replace the gradient reduction of every unit: ``hook(state, grad)`` (NO_SHARD, in place) or
        ``hook(state, padded_unsharded_grad, sharded_grad_out)``."""
        if not self.check_is_root():
            raise AssertionError("register_comm_hook can only be called on a root instance.")
        for unit in FullyShardedDataParallel.fsdp_modules(self):
            if unit.sharding_strategy in _HYBRID:
                raise AssertionError(f"Communication hook is not supported for hybrid strategies: "
                                     f"{unit.sharding_strategy}")
            if unit._comm_hook is not None:
                raise AssertionError("A communication hook is already registered")
            if not callable(hook):
                raise ValueError(f"The communication hook must be callable but got {hook}")
            unit._comm_hook, unit._comm_hook_state = hook, state

    def _comm_hook_of(self) -> tuple[Callable | None, Any]:
        return self._comm_hook, self._comm_hook_state

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients by the norm over all ranks' shards (replicated gradients counted once)."""
        lazy_init(self)
        if not self._is_root:
            raise RuntimeError("`clip_grad_norm_()` should only be called on the root FSDP instance")
        self._assert_state(TrainingState.IDLE)
        norm_type = float(norm_type)
        sharded, replicated = [], []
        seen: set[int] = set()
        for unit in self._all_units:
            handle = unit._handle
            if handle is None:
                continue
            params = [i.param for i in handle.unique] if handle.use_orig_params else [handle.flat]
            for p in params:
                seen.add(id(p))
                (sharded if handle.world > 1 else replicated).append(p)
        replicated += [p for p in self.parameters() if id(p) not in seen]
        grads = [p.grad for p in sharded + replicated if p.grad is not None]
        local_sharded = _grad_norm([p.grad for p in sharded if p.grad is not None], norm_type)
        local_replicated = _grad_norm([p.grad for p in replicated if p.grad is not None], norm_type)
        if math.isinf(norm_type):
            all_reduce(local_sharded, op=ReduceOp.MAX, group=self.process_group)
            total = torch.maximum(local_sharded, local_replicated)
        else:
            total = local_sharded ** norm_type
            all_reduce(total, group=self.process_group)
            total = (total + local_replicated ** norm_type) ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(coef.to(grad.dtype))
        if not grads:
            warnings.warn(f"Called FSDP.clip_grad_norm_() on rank {self.rank} with no gradients -- returning the "
                          "total norm in the default dtype", stacklevel=2)
            return total
        dtype = grads[0].dtype
        for grad in grads[1:]:
            dtype = torch.promote_types(dtype, grad.dtype)
        return total.to(dtype)

    # -- whole parameters and state dicts ------------------------------------------------------------------

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True,
                           rank0_only: bool = False, offload_to_cpu: bool = False,
                           with_grads: bool = False) -> Generator[None, None, None]:
        """Expose the whole original parameters of the FSDP units in ``module`` (written back on exit)."""
        units = FullyShardedDataParallel.fsdp_modules(module)
        if not recurse:
            units = [module] if isinstance(module, FullyShardedDataParallel) else []
        for unit in FullyShardedDataParallel.fsdp_modules(module, root_only=True):
            lazy_init(unit)
        with _fsdp1_state_dict.unshard_params(units, writeback, rank0_only, offload_to_cpu, with_grads):
            yield

    @staticmethod
    def set_state_dict_type(module: nn.Module, state_dict_type: StateDictType, state_dict_config: Any = None,
                            optim_state_dict_config: Any = None) -> StateDictSettings:
        """Set the state-dict type and configs of every FSDP unit in ``module``; returns the previous settings."""
        return _fsdp1_state_dict.set_state_dict_type(module, state_dict_type, state_dict_config,
                                                     optim_state_dict_config)

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        """The settings shared by the FSDP units in ``module`` (AssertionError if they differ)."""
        return _fsdp1_state_dict.get_state_dict_type(module)

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(module: nn.Module, state_dict_type: StateDictType, state_dict_config: Any = None,
                        optim_state_dict_config: Any = None) -> Generator[None, None, None]:
        """Within this context ``state_dict()`` / ``optim_state_dict()`` use the given type and configs."""
        prev = FullyShardedDataParallel.set_state_dict_type(module, state_dict_type, state_dict_config,
                                                            optim_state_dict_config)
        try:
            yield
        finally:
            FullyShardedDataParallel.set_state_dict_type(module, prev.state_dict_type, prev.state_dict_config,
                                                         prev.optim_state_dict_config)

    # -- optimizer state dicts -----------------------------------------------------------------------------

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                         optim_state_dict: dict[str, Any] | None = None,
                         group: ProcessGroup | None = None) -> dict[str, Any]:
        """The optimizer state keyed by parameter names, with whole (unflattened, gathered) state tensors."""
        return _fsdp1_optim.optim_state_dict(model, optim, optim_state_dict)

    @staticmethod
    def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict[str, Any],
                                 is_named_optimizer: bool = False, load_directly: bool = False,
                                 group: ProcessGroup | None = None) -> dict[str, Any]:
        """Convert ``optim_state_dict`` (from ``optim_state_dict``) to this rank's form for
        ``optim.load_state_dict``."""
        osd = _fsdp1_optim.optim_state_dict_to_load(model, optim, optim_state_dict)
        if load_directly:
            optim.load_state_dict(osd)
            return {}
        return osd

    @staticmethod
    def full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_input: Any = None,
                              rank0_only: bool = True, group: ProcessGroup | None = None) -> dict[str, Any]:
        """Deprecated form of ``optim_state_dict`` with a full config (empty on ranks > 0 with ``rank0_only``)."""
        warnings.warn("``FullyShardedDataParallel.full_optim_state_dict``is being deprecated and is replaced by "
                      "``FullyShardedDataParallel.optim_state_dict``. ", FutureWarning, stacklevel=2)
        osd = _fsdp1_optim.optim_state_dict(model, optim, None, force_full=True)
        rank = next(iter(FullyShardedDataParallel.fsdp_modules(model)), None)
        return {} if rank0_only and rank is not None and rank.rank != 0 else osd

    @staticmethod
    def shard_full_optim_state_dict(full_optim_state_dict: dict[str, Any], model: nn.Module,
                                    optim_input: Any = None, optim: torch.optim.Optimizer | None = None
                                    ) -> dict[str, Any]:
        """Deprecated form of ``optim_state_dict_to_load``."""
        if optim is None:
            raise ValueError("torchdist's shard_full_optim_state_dict needs ``optim``; use optim_state_dict_to_load")
        return _fsdp1_optim.optim_state_dict_to_load(model, optim, full_optim_state_dict)


# -- construction helpers -------------------------------------------------------------------------------------


def _check_device(device_id: Any, module: nn.Module) -> None:
    if device_id is None:
        return
    device = device_id if isinstance(device_id, torch.device) else torch.device(device_id)
    if device.type != "cpu":
        raise ValueError(f"FullyShardedDataParallel: torchdist runs FSDP on CPU only, got device_id={device_id!r}; "
                         "pass device_id=torch.device('cpu') or leave it None")


def _ignored(module: nn.Module, ignored_modules: Iterable[nn.Module] | None,
             ignored_states: Iterable[Any] | None) -> tuple[set[nn.Module], set[nn.Parameter]]:
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError("Cannot pass both `ignored_modules` and `ignored_states` at the same time. Please just "
                         "pass `ignored_states`.")
    modules: set[nn.Module] = set()
    params: set[nn.Parameter] = set()
    items = list(ignored_modules if ignored_modules is not None else ignored_states or [])
    if items and all(isinstance(i, nn.Module) for i in items) or ignored_modules is not None:
        for m in items:
            if not isinstance(m, nn.Module):
                raise TypeError(f"ignored_modules expects nn.Module but got {type(m)}")
            if isinstance(m, FullyShardedDataParallel):
                raise ValueError("`ignored_modules` should not include FSDP modules")
            modules.update(m.modules())
        params = {p for m in modules for p in m.parameters()}
    else:
        for p in items:
            if not isinstance(p, nn.Parameter):
                raise ValueError(f"ignored_states expects all nn.Parameter or all nn.Module list elements but got "
                                 f"types {[type(i) for i in items]}")
            params.add(p)
    return modules, params


def _resolve_groups(process_group: Any, device_mesh: Any, strategy: ShardingStrategy,
                    policy: Any) -> tuple[ProcessGroup, ProcessGroup | None]:
    """(shard group, replicate group): the replicate group only for the hybrid strategies."""
    if process_group is not None and device_mesh is not None:
        raise ValueError("Cannot pass both process_group and device_mesh at the same time. Please just pass only "
                         "one of them.")
    if strategy in _HYBRID:
        if process_group is None and policy is None and device_mesh is None:
            raise ValueError(f"Manual wrapping with {strategy} requires explicit specification of process group or "
                             "device_mesh.")
        if device_mesh is not None:
            if device_mesh.ndim != 2:
                raise ValueError(f"{strategy} expects a 2D DeviceMesh (replicate, shard) but got {device_mesh}")
            return device_mesh.get_group(1), device_mesh.get_group(0)
        if isinstance(process_group, tuple):
            if len(process_group) != 2:
                raise ValueError(f"Expected process_group to be passed in as either None or Tuple[dist.ProcessGroup, "
                                 f"dist.ProcessGroup] but got {process_group}")
            return WORLD.resolve(process_group[0]), process_group[1]
        # one host: every rank is "intra-node", so the shard group is the whole group and nothing replicates
        return WORLD.resolve(process_group), None
    if device_mesh is not None:
        return device_mesh.get_group(0), None
    return WORLD.resolve(process_group), None


def _materialize(module: nn.Module, param_init_fn: Callable | None, ignored: set[nn.Module]) -> None:
    """Initialize modules whose parameters are on the meta device (``param_init_fn``, else ``reset_parameters``)."""
    todo = [m for m in _unit_modules(module) if m not in ignored and any(
        t.is_meta for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)])]
    for m in todo:
        if param_init_fn is not None:
            param_init_fn(m)
        else:
            m.to_empty(device=torch.device("cpu"), recurse=False)
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()


def _unit_modules(module: nn.Module) -> list[nn.Module]:
    """The modules of this unit: ``module``'s subtree without nested FSDP units."""
    out, stack = [], [module]
    while stack:
        m = stack.pop()
        out.append(m)
        stack.extend(c for c in reversed(list(m.children())) if not isinstance(c, FullyShardedDataParallel))
    return out


def _collect_params(module: nn.Module, ignored: set[nn.Parameter]) -> list[ParamInfo]:
    """The parameters this unit flattens, in ``named_parameters`` order; shared ones point at their first use."""
    infos: list[ParamInfo] = []
    first: dict[int, int] = {}
    for mod_name, sub in module.named_modules(remove_duplicate=False):
        for name, param in list(sub._parameters.items()):
            if param is None or param in ignored or getattr(param, FSDP_FLATTENED, False):
                continue
            fqn = f"{mod_name}.{name}" if mod_name else name
            infos.append(ParamInfo(sub, name, fqn, param, shared_with=first.get(id(param))))
            first.setdefault(id(param), len(infos) - 1)
    return infos


def _sync_module_states(module: nn.Module, infos: list[ParamInfo], group: ProcessGroup,
                        replicate: ProcessGroup | None, ignored_buffers: set[int]) -> None:
    """Broadcast the unit's parameters and buffers from rank 0 so that every rank shards the same values."""
    tensors = [i.param.detach() for i in infos if i.shared_with is None]
    tensors += [b for m in _unit_modules(module) for b in m.buffers(recurse=False) if id(b) not in ignored_buffers]
    with torch.no_grad():
        for grp in (group, replicate):
            if grp is None or grp.size() == 1:
                continue
            for tensor in tensors:
                broadcast(tensor, src=get_global_rank(grp, 0), group=grp)


def _grad_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    if not grads:
        return torch.tensor(0.0)
    norms = torch.stack([torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32) for g in grads])
    return torch.linalg.vector_norm(norms, norm_type, dtype=torch.float32)
