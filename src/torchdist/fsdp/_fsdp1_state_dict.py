"""How FSDP1 shows whole parameters: ``summon_full_params`` and the model state dicts.

``unshard_params`` gathers each unit's flat parameter in full precision and
registers the original parameters as ``nn.Parameter`` views of it; on exit it
writes this rank's part back into the shard (``writeback``) and frees it.

State dicts are nn.Module hooks on every unit; the outermost unit of a call
(the *owner*) does the work for its subtree:

- FULL_STATE_DICT: save = unshard, let ``nn.Module`` collect the views, strip
  ``_fsdp_wrapped_module.``, clone (with ``rank0_only``, ranks > 0 keep only the
  entries of NO_SHARD units, as PyTorch does);
  load = unshard, rename the keys back, let ``nn.Module`` copy into the views,
  write back.
- SHARDED_STATE_DICT: as FULL, then every parameter FSDP shards becomes this
  rank's dim-0 chunk, a DTensor ``Shard(0)`` on the unit's shard group (PyTorch
  gives a ShardedTensor unless FSDP got a device_mesh); load = the DTensors made
  whole (``full_tensor``), then as FULL. ``torchdist.checkpoint`` saves these.
- LOCAL_STATE_DICT: each unit's ``_flat_param`` is this rank's unpadded part of
  the flat shard (PyTorch wraps it in a ``ShardedTensor``; torchdist gives the
  plain tensor), with the clean key ``<unit>._flat_param``; with ``use_orig_params``
  the original parameters (their 1-D parts of the shard) are saved too, as in
  PyTorch. NO_SHARD units have no shard and save a full state dict instead.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING, Any, Generator

import torch
import torch.nn as nn

from .._c10d.collectives import all_gather_into_tensor
from ..device_mesh import DeviceMesh
from ..tensor import DTensor, Shard, distribute_tensor
from ._flat_param import FLAT_PARAM, FSDP_PREFIX
from ._fsdp1_runtime import TrainingState, lazy_init
from .api import (FullOptimStateDictConfig, FullStateDictConfig, LocalOptimStateDictConfig, LocalStateDictConfig,
                  ShardedOptimStateDictConfig, ShardedStateDictConfig, ShardingStrategy, StateDictSettings,
                  StateDictType)

if TYPE_CHECKING:
    from .fully_sharded_data_parallel import FullyShardedDataParallel

__all__ = ["unshard_params", "register_hooks", "sharded_params", "set_state_dict_type", "get_state_dict_type"]

_CONFIGS = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
}


@contextlib.contextmanager
def unshard_params(units: list[FullyShardedDataParallel], writeback: bool, rank0_only: bool, offload_to_cpu: bool,
                   with_grads: bool) -> Generator[None, None, None]:
    """Gather the whole original parameters of ``units`` for the duration of the context."""
    for unit in units:
        handle = unit._handle
        if with_grads and (offload_to_cpu or not unit._use_orig_params):
            raise NotImplementedError(f"with_grads={with_grads}, use_orig_params={unit._use_orig_params}, "
                                      f"offload_to_cpu={offload_to_cpu} is not supported yet")
        if offload_to_cpu and handle is not None and handle.world == 1:
            raise NotImplementedError("offload_to_cpu=True and NO_SHARD is not supported yet")
        if writeback and rank0_only:
            raise NotImplementedError("writeback=True and rank0_only=True is not supported yet")
        if unit.training_state != TrainingState.IDLE:
            raise AssertionError(f"Expects the FSDP unit to be IDLE but got {unit.training_state}: "
                                 "summon_full_params cannot run inside forward or backward")
    if offload_to_cpu and not rank0_only:
        warnings.warn("offload_to_cpu=True and rank0_only=False may result in the unsharded parameters being "
                      "redundantly copied to CPU memory for GPUs sharing the same CPU memory, which risks CPU OOM. We "
                      "recommend using offload_to_cpu=True with rank0_only=True.", stacklevel=3)
    entered: list[tuple[FullyShardedDataParallel, bool, bool, list]] = []
    try:
        for unit in units:
            unit.training_state = TrainingState.SUMMON_FULL_PARAMS
            handle = unit._handle
            if handle is None:
                entered.append((unit, False, False, []))
                continue
            was_unsharded = handle.unsharded and handle._needs_swap
            handle.reshard()
            handle.unshard(full_precision=True)
            # A NO_SHARD unit's parameters are whole on every rank: shown there too (its state dict entries
            # are on every rank in PyTorch, rank0_only or not).
            shown = not rank0_only or unit.rank == 0 or unit.sharding_strategy == ShardingStrategy.NO_SHARD
            saved_grads = _gather_grads(handle) if with_grads else []
            if shown:
                handle.use_unsharded_views(as_params=True)
                if not unit._use_orig_params:
                    unit._fsdp_wrapped_module._parameters.pop(FLAT_PARAM, None)
                for info, grad in getattr(handle, "_summon_grads", []) if with_grads else []:
                    info.param.grad = grad
            else:
                handle.reshard()
            entered.append((unit, was_unsharded, shown, saved_grads))
        yield
    finally:
        for unit, was_unsharded, shown, saved_grads in reversed(entered):
            handle = unit._handle
            unit.training_state = TrainingState.IDLE
            if handle is None:
                continue
            if shown:
                if writeback:
                    handle.writeback()
                handle.reshard()
                handle.use_sharded_views()
                if not unit._use_orig_params:
                    unit._fsdp_wrapped_module._parameters[FLAT_PARAM] = handle.flat
            for info, grad in saved_grads:
                info.param.grad = grad
            if was_unsharded:  # e.g. the root after a forward without backward: gathered again, as it was
                handle.unshard()
                if not unit._use_orig_params:  # (the original parameters stay the registered sharded views)
                    handle.use_unsharded_views(as_params=False)


def _gather_grads(handle) -> list:
    """``with_grads``: give the original parameters their whole gradients; returns their sharded ones."""
    saved = [(info, info.param.grad) for info in handle.unique]
    handle._summon_grads = []
    if all(g is None for _, g in saved):
        return saved
    shard = torch.zeros(handle.local_shard.shape, dtype=handle.dtype)
    for info, grad in saved:
        if grad is not None:
            handle.sharded_view(info, shard).copy_(grad)
    full = shard
    if handle.world > 1:
        full = torch.empty(handle.chunk * handle.world, dtype=handle.dtype)
        all_gather_into_tensor(full, shard, group=handle.shard_group)
    views = handle.unsharded_views(full[:handle.numel])
    handle._summon_grads = [(info, view) for info, view in zip(handle.infos, views) if info.shared_with is None]
    return saved


# -- state dict hooks -------------------------------------------------------------------------------------------

_owner: list[FullyShardedDataParallel] = []  # the unit whose state_dict / load_state_dict call is running


def register_hooks(unit: FullyShardedDataParallel) -> None:
    unit.register_state_dict_pre_hook(_pre_save)
    unit.register_state_dict_post_hook(_post_save)
    unit.register_load_state_dict_pre_hook(_pre_load)
    unit.register_load_state_dict_post_hook(_post_load)


def _units_of(owner: FullyShardedDataParallel) -> list[FullyShardedDataParallel]:
    return type(owner).fsdp_modules(owner)


def _effective(unit: FullyShardedDataParallel) -> tuple[StateDictType, Any]:
    """The state-dict type and config ``unit`` uses: a NO_SHARD unit has no shard to save, so it saves and loads
    a full state dict whatever type is set (as PyTorch, with the same warning)."""
    if unit.sharding_strategy == ShardingStrategy.NO_SHARD and unit._state_dict_type != StateDictType.FULL_STATE_DICT:
        warnings.warn("When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will be returned.",
                      stacklevel=4)
        return StateDictType.FULL_STATE_DICT, FullStateDictConfig()
    return unit._state_dict_type, unit._state_dict_config


def _enter(owner: FullyShardedDataParallel, writeback: bool, rank0_only: bool) -> None:
    state_dict_type = _effective(owner)[0]
    lazy_init(owner)
    owner._sd_context = contextlib.ExitStack()
    if state_dict_type in (StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT):
        owner._sd_context.enter_context(unshard_params(_units_of(owner), writeback=writeback,
                                                       rank0_only=rank0_only, offload_to_cpu=False,
                                                       with_grads=False))
    _owner.append(owner)


def _exit(owner: FullyShardedDataParallel) -> None:
    _owner.remove(owner)
    owner._sd_context.close()


def _pre_save(unit: FullyShardedDataParallel, prefix: str, keep_vars: bool) -> None:
    if not _owner:
        config = _effective(unit)[1]
        _enter(unit, writeback=False, rank0_only=getattr(config, "rank0_only", False))


def _post_save(unit: FullyShardedDataParallel, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    if _effective(unit)[0] == StateDictType.LOCAL_STATE_DICT and unit._handle is not None:
        handle = unit._handle
        valid = max(0, min(handle.chunk, handle.numel - handle.rank * handle.chunk))
        state_dict.pop(prefix + FSDP_PREFIX + FLAT_PARAM, None)
        state_dict[prefix + FSDP_PREFIX + FLAT_PARAM] = handle.local_shard[:valid]
    if not _owner or _owner[-1] is not unit:
        return
    try:
        state_dict_type, config = _effective(unit)
        full = state_dict_type == StateDictType.FULL_STATE_DICT
        sharded = sharded_params(unit) if state_dict_type == StateDictType.SHARDED_STATE_DICT else {}
        items = [(k, v) for k, v in state_dict.items() if k.startswith(prefix)]
        for key, _ in items:
            del state_dict[key]
        if full and getattr(config, "rank0_only", False) and unit.rank != 0:
            items = _unsharded_items(unit, prefix, items)
        for key, value in items:
            name = key[len(prefix):].replace(FSDP_PREFIX, "")
            if name in sharded:  # this rank's dim-0 chunk of the whole parameter, as a DTensor
                mesh = sharded[name]
                value = distribute_tensor(value.detach(), mesh, [Shard(0)], src_data_rank=None)  # no communication
            elif full and isinstance(value, torch.Tensor):
                value = value.detach().clone()
            if config.offload_to_cpu and isinstance(value, torch.Tensor):
                value = value.cpu()
            state_dict[prefix + name] = value
    finally:
        _exit(unit)


def _unsharded_items(owner: FullyShardedDataParallel, prefix: str, items: list[tuple[str, Any]]) -> list:
    """FULL_STATE_DICT with ``rank0_only`` on a rank > 0: the entries of NO_SHARD units only, as in PyTorch
    (their parameters and buffers are whole on every rank; a sharded unit's are gathered on rank 0 only)."""
    units = sorted(((prefix + fqn + "." if fqn else prefix, sub) for fqn, sub in owner.named_modules()
                    if isinstance(sub, type(owner))), key=lambda pair: -len(pair[0]))

    def unit_of(key: str) -> FullyShardedDataParallel:  # the innermost unit whose subtree holds ``key``
        return next(sub for start, sub in units if key.startswith(start))
    return [(key, value) for key, value in items if unit_of(key).sharding_strategy == ShardingStrategy.NO_SHARD]


def sharded_params(owner: FullyShardedDataParallel) -> dict[str, DeviceMesh]:
    """SHARDED_STATE_DICT: the names (relative to ``owner``, without FSDP's prefixes) of the parameters FSDP
    shards, each with the 1-D mesh of its unit's shard group. PyTorch gives ShardedTensors, or DTensors when FSDP
    was given a device_mesh; torchdist gives DTensors ``Shard(0)`` always (what torchdist.checkpoint saves)."""
    meshes: dict[int, DeviceMesh] = {}
    names: dict[str, DeviceMesh] = {}
    for fqn, sub in owner.named_modules():
        if not isinstance(sub, type(owner)) or sub._handle is None or sub._handle.world == 1:
            continue
        group = sub._handle.shard_group
        mesh = meshes.setdefault(id(group), DeviceMesh.from_group(group, "cpu"))
        base = (fqn + "." if fqn else "").replace(FSDP_PREFIX, "")
        for info in sub._handle.unique:
            names[(base + info.fqn).replace(FSDP_PREFIX, "")] = mesh
    return names


def _pre_load(unit: FullyShardedDataParallel, state_dict: dict, prefix: str, local_metadata: Any, strict: bool,
              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    if _owner:
        return
    _enter(unit, writeback=True, rank0_only=False)
    actual = {}
    for name, _ in nn.Module.named_parameters(unit, prefix=prefix[:-1] if prefix else "", remove_duplicate=False):
        actual[name.replace(FSDP_PREFIX, "")] = name
    for name, _ in nn.Module.named_buffers(unit, prefix=prefix[:-1] if prefix else "", remove_duplicate=False):
        actual[name.replace(FSDP_PREFIX, "")] = name
    if _effective(unit)[0] == StateDictType.LOCAL_STATE_DICT:
        for fqn, sub in unit.named_modules(prefix=prefix[:-1] if prefix else ""):
            if isinstance(sub, type(unit)) and sub._handle is not None and \
                    _effective(sub)[0] == StateDictType.LOCAL_STATE_DICT:
                clean = (fqn + "." if fqn else "").replace(FSDP_PREFIX, "") + FLAT_PARAM
                value = state_dict.pop(clean, None)
                if value is None:
                    continue
                handle = sub._handle
                with torch.no_grad():
                    handle.local_shard.zero_()
                    handle.local_shard[:value.numel()].copy_(value.reshape(-1))
                if not sub._use_orig_params:
                    state_dict[(fqn + "." if fqn else "") + FSDP_PREFIX + FLAT_PARAM] = handle.local_shard.clone()
    for key in [k for k in state_dict if k.startswith(prefix)]:
        if isinstance(state_dict[key], DTensor):  # SHARDED_STATE_DICT: the whole parameter, then loaded as full
            state_dict[key] = state_dict[key].full_tensor()
        if key in actual and actual[key] != key:
            state_dict[actual[key]] = state_dict.pop(key)


def _post_load(unit: FullyShardedDataParallel, incompatible_keys: Any) -> None:
    if _owner and _owner[-1] is unit:
        _exit(unit)


# -- state dict settings ----------------------------------------------------------------------------------------


def set_state_dict_type(module: nn.Module, state_dict_type: StateDictType, state_dict_config: Any,
                        optim_state_dict_config: Any) -> StateDictSettings:
    from .fully_sharded_data_parallel import FullyShardedDataParallel

    config_type, optim_config_type = _CONFIGS[state_dict_type]
    state_dict_config = state_dict_config if state_dict_config is not None else config_type()
    optim_state_dict_config = optim_state_dict_config if optim_state_dict_config is not None else optim_config_type()
    if type(state_dict_config) is not config_type:
        raise RuntimeError(f"Expected state_dict_config of type {config_type} but got {type(state_dict_config)}")
    if type(optim_state_dict_config) is not optim_config_type:
        raise RuntimeError(f"Expected optim_state_dict_config of type {optim_config_type} "
                           f"but got {type(optim_state_dict_config)}")
    units = FullyShardedDataParallel.fsdp_modules(module)
    if not units:
        raise ValueError(f"set_state_dict_type: {type(module).__name__} contains no FullyShardedDataParallel "
                         "module; wrap it with FSDP first")
    prev = get_state_dict_type(module)
    for unit in units:
        unit._state_dict_type = state_dict_type
        unit._state_dict_config = state_dict_config
        unit._optim_state_dict_config = optim_state_dict_config
    return prev


def get_state_dict_type(module: nn.Module) -> StateDictSettings:
    from .fully_sharded_data_parallel import FullyShardedDataParallel

    settings = None
    for unit in FullyShardedDataParallel.fsdp_modules(module):
        mine = StateDictSettings(unit._state_dict_type, unit._state_dict_config, unit._optim_state_dict_config)
        if settings is None:
            settings = mine
        elif settings != mine:
            raise AssertionError(f"All FSDP modules must have the same state dict settings.Got {mine} and "
                                 f"{settings}.")
    if settings is None:
        raise AssertionError("No FSDP modules in module")
    return settings
