"""FSDP1 optimizer state dicts: between the optimizer's sharded, id-keyed states and whole states keyed by
parameter names.

A unit's optimizer states live in the same layout as its flat parameter: one
flat shard (``use_orig_params=False``) or, per original parameter, its 1-D part
of the shard (``True``; ranks holding no element have no state). Saving puts
each state's pieces back into a flat shard, all-gathers it over the shard group
and cuts out each parameter in its shape; loading does the reverse without
communication (every rank holds the whole states). Scalar states (``step``) are
the same on every rank and are copied.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from .._c10d.collectives import all_gather_into_tensor
from .._c10d.object_collectives import all_gather_object
from ..tensor import DTensor, Shard, distribute_tensor
from ._flat_param import FSDP_WRAPPED_MODULE, FlatParamHandle, ParamInfo
from ._fsdp1_runtime import lazy_init
from ._fsdp1_state_dict import sharded_params
from .api import StateDictType

if TYPE_CHECKING:
    from .fully_sharded_data_parallel import FullyShardedDataParallel

__all__ = ["optim_state_dict", "optim_state_dict_to_load"]



class _Owner:
    """What one optimizer parameter is: a unit's flat parameter, one of its original parameters, or neither."""

    def __init__(self, handle: FlatParamHandle | None, infos: list[ParamInfo], fqns: list[str]) -> None:
        self.handle, self.infos, self.fqns = handle, infos, fqns


def _clean(name: str) -> str:
    return ".".join(part for part in name.split(".") if part != FSDP_WRAPPED_MODULE)


def _owners(model: nn.Module) -> tuple[list[FullyShardedDataParallel], dict[int, _Owner]]:
    """The FSDP units of ``model`` (collective order) and, per parameter object, what it is and its names."""
    from .fully_sharded_data_parallel import FullyShardedDataParallel

    for root in FullyShardedDataParallel.fsdp_modules(model, root_only=True):
        lazy_init(root)
    units = FullyShardedDataParallel.fsdp_modules(model)
    owners: dict[int, _Owner] = {}
    for name, module in model.named_modules():
        if not isinstance(module, FullyShardedDataParallel) or module._handle is None:
            continue
        handle = module._handle
        base = _clean(name)
        fqn = [(base + "." if base else "") + info.fqn for info in handle.unique]
        if handle.use_orig_params:
            for info, f in zip(handle.unique, fqn):
                owners[id(info.param)] = _Owner(handle, [info], [f])
        else:
            owners[id(handle.flat)] = _Owner(handle, list(handle.unique), fqn)
    for name, param in model.named_parameters():
        owners.setdefault(id(param), _Owner(None, [], [_clean(name)]))
    return units, owners


def _settings(model: nn.Module) -> Any:
    from .fully_sharded_data_parallel import FullyShardedDataParallel

    return FullyShardedDataParallel.get_state_dict_type(model)


def _params(optim: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [p for group in optim.param_groups for p in group["params"]]


def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, osd: dict[str, Any] | None,
                     force_full: bool = False) -> dict[str, Any]:
    settings = _settings(model) if not force_full else None
    config = settings.optim_state_dict_config if settings is not None else None
    osd = optim.state_dict() if osd is None else osd
    units, owners = _owners(model)
    params = _params(optim)
    index_of = {id(p): i for i, p in enumerate(params)}
    state_in = osd["state"]
    out_state: dict[str, dict[str, Any]] = {}
    for unit in units:  # every rank, same order: the gathers are collectives
        handle = unit._handle
        if handle is None:
            continue
        local = {}  # unique-info index -> its local state
        for i, info in enumerate(handle.unique):
            key = index_of.get(id(info.param if handle.use_orig_params else handle.flat))
            if key is not None and key in state_in:
                local[i] = state_in[key]
        if not any(id(info.param if handle.use_orig_params else handle.flat) in index_of for info in handle.unique):
            continue
        out_state.update(_gather_unit(handle, local, owners))
    for param in params:  # parameters FSDP does not manage
        owner = owners.get(id(param))
        if owner is not None and owner.handle is None and index_of[id(param)] in state_in:
            out_state[owner.fqns[0]] = copy.copy(state_in[index_of[id(param)]])
    rank0_only = getattr(config, "rank0_only", False)
    if rank0_only and units and units[0].rank != 0:
        return {}
    ordered = {f: out_state[f] for p in params for f in owners[id(p)].fqns if f in out_state}
    if settings is not None and settings.state_dict_type != StateDictType.FULL_STATE_DICT:
        ordered = _to_dtensors(ordered, sharded_params(model))  # as PyTorch: LOCAL and SHARDED give sharded states
    if any(unit._use_orig_params for unit in units):  # PyTorch's order then: by name
        ordered = dict(sorted(ordered.items()))
    groups = []
    for group in osd["param_groups"]:
        names = [f for idx in group["params"] for f in owners[id(params[idx])].fqns]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    return {"state": ordered, "param_groups": groups}


def _gather_unit(handle: FlatParamHandle, local: dict[int, dict[str, Any]],
                 owners: dict[int, _Owner]) -> dict[str, dict[str, Any]]:
    """Whole per-parameter states of one unit, from each rank's flat (or per-parameter) shards."""
    meta = {}
    for i, state in local.items():
        meta[i] = {k: ("t", v.dtype) if _is_sharded_state(v) else ("s", v) for k, v in state.items()}
    metas = [None] * handle.world
    if handle.world > 1:
        all_gather_object(metas, meta, group=handle.shard_group)
    else:
        metas = [meta]
    merged: dict[int, dict[str, Any]] = {}
    for rank_meta in metas:
        for i, entries in rank_meta.items():
            for k, v in entries.items():
                merged.setdefault(i, {}).setdefault(k, v)
    tensor_keys = sorted({k for entries in merged.values() for k, v in entries.items() if v[0] == "t"})
    fqns = {i: _fqn_of(handle, info, owners) for i, info in enumerate(handle.unique)}
    out: dict[str, dict[str, Any]] = {fqns[i]: {} for i in sorted(merged)}
    for k in tensor_keys:
        dtype = next(v[1] for entries in merged.values() for kk, v in entries.items() if kk == k and v[0] == "t")
        shard = torch.zeros(handle.local_shard.shape, dtype=dtype)
        for i, state in local.items():
            if k in state and _is_sharded_state(state[k]):
                value = state[k]
                if handle.use_orig_params:
                    handle.sharded_view(handle.unique[i], shard).copy_(value.reshape(-1) if handle.world > 1 else value)
                else:
                    shard.copy_(value)
        full = shard
        if handle.world > 1:
            full = torch.empty(handle.chunk * handle.world, dtype=dtype)
            all_gather_into_tensor(full, shard, group=handle.shard_group)
        for i, entries in merged.items():
            if k in entries:
                info = handle.unique[i]
                out[fqns[i]][k] = full[info.offset:info.offset + info.numel].view(info.shape).clone()
    for i, entries in merged.items():
        for k, v in entries.items():
            if v[0] == "s":  # a copy: the optimizer keeps updating its own ``step`` tensor
                out[fqns[i]][k] = v[1].clone() if isinstance(v[1], torch.Tensor) else v[1]
    order = _key_order if handle.use_orig_params else _flat_key_order
    return {f: dict(sorted(s.items(), key=lambda kv: order(merged, kv))) for f, s in out.items()}


def _key_order(merged: dict, item: tuple[str, Any]) -> int:
    """The optimizer's own order of the state keys (PyTorch's order with ``use_orig_params=True``)."""
    for entries in merged.values():
        keys = list(entries)
        if item[0] in keys:
            return keys.index(item[0])
    return 0


def _flat_key_order(merged: dict, item: tuple[str, Any]) -> tuple[int, str]:
    """PyTorch's order for states unflattened from a flat parameter's: the sharded tensor states, then the
    0-dim tensors (``step``), then other values, each group by name."""
    key, value = item
    group = 0 if _is_sharded_state(value) else 1 if isinstance(value, torch.Tensor) else 2
    return group, key


def _fqn_of(handle: FlatParamHandle, info: ParamInfo, owners: dict[int, _Owner]) -> str:
    owner = owners[id(info.param if handle.use_orig_params else handle.flat)]
    return owner.fqns[owner.infos.index(info)] if not handle.use_orig_params else owner.fqns[0]


def _is_sharded_state(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _to_dtensors(state: dict[str, dict[str, Any]], meshes: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """SHARDED_STATE_DICT: each parameter's tensor states as this rank's dim-0 chunk (DTensor ``Shard(0)``), like
    the parameters in the model's sharded state dict."""
    out = {}
    for fqn, entries in state.items():
        mesh = meshes.get(fqn)
        out[fqn] = {key: distribute_tensor(value, mesh, [Shard(0)], src_data_rank=None)  # (no communication)
                    if mesh is not None and _is_sharded_state(value) else value
                    for key, value in entries.items()}
    return out


def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer,
                             osd: dict[str, Any]) -> dict[str, Any]:
    _settings(model)
    _, owners = _owners(model)
    params = _params(optim)
    state_in = {fqn: {key: value.full_tensor() if isinstance(value, DTensor) else value
                      for key, value in entries.items()} for fqn, entries in osd["state"].items()}
    state_out: dict[int, dict[str, Any]] = {}
    for index, param in enumerate(params):
        owner = owners.get(id(param))
        if owner is None:
            raise KeyError(f"optim_state_dict_to_load: an optimizer parameter (index {index}) is not a parameter "
                           "of the model; build the optimizer from model.parameters() after wrapping with FSDP")
        if owner.handle is None:
            if owner.fqns[0] in state_in:
                state_out[index] = copy.copy(state_in[owner.fqns[0]])
            continue
        handle = owner.handle
        present = [(info, state_in[f]) for info, f in zip(owner.infos, owner.fqns) if f in state_in]
        if not present:
            continue
        result: dict[str, Any] = {}
        for key, value in present[0][1].items():
            if not _is_sharded_state(value):
                result[key] = value.clone() if isinstance(value, torch.Tensor) else value
                continue
            full = torch.zeros(handle.chunk * handle.world, dtype=value.dtype)
            for info, state in present:
                full[info.offset:info.offset + info.numel].copy_(state[key].reshape(-1))
            shard = full[handle.rank * handle.chunk:(handle.rank + 1) * handle.chunk]
            if handle.use_orig_params:
                shard = handle.sharded_view(owner.infos[0], shard)
            result[key] = shard.clone()
        if handle.use_orig_params and handle.world > 1 and handle.local_range(owner.infos[0])[1] == \
                handle.local_range(owner.infos[0])[0]:
            continue  # no element of this parameter here: the optimizer keeps no state for it
        state_out[index] = result
    groups = []
    offset = 0
    for mine, theirs in zip(optim.param_groups, osd["param_groups"]):
        ids = list(range(offset, offset + len(mine["params"])))
        offset += len(ids)
        groups.append({**{k: v for k, v in theirs.items() if k != "params"}, "params": ids})
    return {"state": state_out, "param_groups": groups}
