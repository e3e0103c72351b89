"""Model and optimizer state_dicts keyed by the model's own parameter names, whatever wraps the model.

``get_*`` return ``{fqn: tensor}`` for a model, and for optimizers
``{"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}]}``:
the FQN (fully qualified name) of a parameter is its name in the unwrapped
model, so DDP's ``module.`` prefix and ``torch.compile``'s ``_orig_mod.`` are
dropped, and optimizer state is keyed by FQN instead of by position. That
makes a checkpoint independent of the wrappers and of the number of ranks.
``set_*`` take such dicts back, adding the prefixes again. DTensor parameters
(FSDP2, tensor parallel) stay DTensors, or with ``full_state_dict`` become
full tensors; wrappers are recognised by their interface (a DDP's ``module``,
a compiled module's ``_orig_mod``), so that this layer does not import them.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from .._c10d.collectives import broadcast
from .._c10d.init import get_rank, is_initialized
from .._c10d.object_collectives import broadcast_object_list
from ..fsdp import FullyShardedDataParallel, StateDictType
from ..tensor import DTensor
from ._chunks import narrow, tensor_view

__all__ = [
    "StateDictOptions", "get_model_state_dict", "get_optimizer_state_dict", "get_state_dict",
    "set_model_state_dict", "set_optimizer_state_dict", "set_state_dict",
]

_STATE = "state"
_PG = "param_groups"
_PARAMS = "params"
_CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."  # activation checkpointing's wrapper, dropped as PyTorch does


@dataclass
class StateDictOptions:
    """How the state_dict helpers behave (PyTorch's fields and defaults).

    full_state_dict: DTensors become full tensors (every rank gets them).
    cpu_offload: tensors move to CPU; with full_state_dict only rank 0 keeps them.
    ignore_frozen_params: parameters with requires_grad=False are left out.
    keep_submodule_prefixes: with ``submodules``, keep the submodule's prefix.
    strict: set_* require every key (passed to ``load_state_dict``).
    broadcast_from_rank0: set_* take the values from rank 0 (others may pass {}).
    flatten_optimizer_state_dict: optimizer state as one flat ``state.<fqn>.<k>`` dict.
    """

    full_state_dict: bool = False
    cpu_offload: bool = False
    ignore_frozen_params: bool = False
    keep_submodule_prefixes: bool = True
    strict: bool = True
    broadcast_from_rank0: bool = False
    flatten_optimizer_state_dict: bool = False
    dsd_fqn_modifiers: str = "_fqn_modifiers"


# -- names --------------------------------------------------------------------------------------------------------

def _is_ddp(module: nn.Module) -> bool:
    return type(module).__name__ == "DistributedDataParallel" and isinstance(getattr(module, "module", None),
                                                                               nn.Module)


def _is_compiled(module: nn.Module) -> bool:
    return type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None), nn.Module)


def _fqn(model: nn.Module, key: str) -> str:
    """The name of state_dict key ``key`` in the unwrapped model: wrapper attributes on the path are dropped."""
    key = key.replace(_CHECKPOINT_PREFIX, "")
    kept = []
    current: Any = model
    for part in key.split("."):
        if isinstance(current, nn.Module) and _is_ddp(current) and part == "module":
            current = current.module
        elif isinstance(current, nn.Module) and _is_compiled(current) and part == "_orig_mod":
            current = current._orig_mod
        else:
            kept.append(part)
            current = getattr(current, part, None)
    return ".".join(kept)


def _unwrap_state_dict(model: nn.Module, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Rename keys to FQNs in place (a renamed key moves to the end, as in PyTorch)."""
    for key in list(state_dict):
        fqn = _fqn(model, key)
        if fqn != key:
            state_dict[fqn] = state_dict.pop(key)
    return state_dict


# -- values -------------------------------------------------------------------------------------------------------

def _full_or_cpu(value: Any, options: StateDictOptions) -> Any:
    """``value`` with DTensors made full (full_state_dict) and tensors moved to CPU (cpu_offload), recursively."""
    if isinstance(value, dict):
        return {k: _full_or_cpu(v, options) for k, v in value.items()}
    if isinstance(value, list):
        return [_full_or_cpu(v, options) for v in value]
    if isinstance(value, torch.Tensor):
        if options.full_state_dict and isinstance(value, DTensor):
            value = value.full_tensor()
        if options.cpu_offload:
            value = value.cpu()
    return value


def _finish(state_dict: dict[str, Any], options: StateDictOptions) -> dict[str, Any]:
    if not options.full_state_dict and not options.cpu_offload:
        return state_dict
    state_dict = _full_or_cpu(state_dict, options)
    if options.full_state_dict and options.cpu_offload and is_initialized() and get_rank() != 0:
        return {}  # PyTorch keeps a full CPU state_dict on rank 0 only
    return state_dict


def _like(current: Any, given: Any) -> Any:
    """``given`` in the form of ``current``: a full tensor given for a DTensor becomes this rank's shard of it."""
    if not (isinstance(current, DTensor) and isinstance(given, torch.Tensor) and not isinstance(given, DTensor)):
        return given
    view = tensor_view(current)
    if tuple(given.shape) != tuple(view.size):
        raise ValueError(f"set_state_dict: a full tensor of shape {tuple(given.shape)} was given for a DTensor of "
                         f"global shape {tuple(view.size)}")
    local = current.to_local().detach()
    # a model built on the meta device (to be materialized by this load) has no data to clone
    local = torch.empty_like(local, device=given.device) if local.is_meta else local.clone()
    for chunk in view.chunks:
        local.copy_(narrow(given, chunk.offsets, chunk.tensor.shape))
    return type(current).from_local(local, current.device_mesh, current.placements, run_check=False,
                                    shape=current.shape, stride=current.stride())


def _broadcast_from_rank0(state_dict: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """Rank 0's values of ``keys`` on every rank: structure and non-tensors as objects, tensors by broadcast."""
    rank0 = get_rank() == 0
    layout = [[(k, (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("obj", v))
               for k, v in state_dict.items() if k in keys] if rank0 else None]
    broadcast_object_list(layout, src=0)
    out = {}
    for key, (shape, info) in layout[0]:
        if shape == "obj":
            out[key] = info
            continue
        tensor = state_dict[key].detach().cpu().contiguous() if rank0 else torch.empty(shape, dtype=info)
        broadcast(tensor, src=0)
        out[key] = tensor
    return out


# -- optimizers ---------------------------------------------------------------------------------------------------

def _as_tuple(optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer]) -> tuple:
    return (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)


def _init_optim_state(optim: torch.optim.Optimizer) -> None:
    """Create an optimizer's state (a step with zero gradients and lr 0) so that its keys exist before loading."""
    if optim.state:
        return
    params = [p for group in optim.param_groups for p in group[_PARAMS]]
    if any(p.grad is not None for p in params):
        return  # a step is pending; its gradients are not ours to touch
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = []
    for group in optim.param_groups:
        if "lr" in group:
            lrs.append(group["lr"])
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    optim.step(closure=None)
    for group in optim.param_groups:
        if "lr" in group:
            group["lr"] = lrs.pop(0)
    optim.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _fsdp1_state_dict_type(model: nn.Module, options: StateDictOptions) -> Iterator[bool]:
    """Inside: ``model``'s FSDP1 units (if any, yields True) give whole tensors with ``full_state_dict``, else
    ``Shard(0)`` DTensors, as PyTorch sets FULL_STATE_DICT or SHARDED_STATE_DICT around these helpers."""
    if not FullyShardedDataParallel.fsdp_modules(model):
        yield False
        return
    kind = StateDictType.FULL_STATE_DICT if options.full_state_dict else StateDictType.SHARDED_STATE_DICT
    with FullyShardedDataParallel.state_dict_type(model, kind):
        yield True


def _param_fqns(model: nn.Module) -> dict[nn.Parameter, str]:
    return {param: _fqn(model, name) for name, param in model.named_parameters()}


def _flatten_optim(osd: dict[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}

    def put(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                put(f"{prefix}.{k}", v)
        elif isinstance(value, (torch.Tensor, int, float)):
            flat[prefix] = value
        else:
            raise NotImplementedError("Flattening optimizer state_dict only supports tensor, int, float, dict "
                                      f"states now. Type is {type(value)}.")

    for fqn, state in osd[_STATE].items():
        put(f"{_STATE}.{fqn}", state)
    for group in osd[_PG]:
        for fqn in group[_PARAMS]:
            for key, value in group.items():
                if key != _PARAMS:
                    flat[f"{_PG}.{fqn}.{key}"] = value
    return flat


def _unflatten_optim(flat: dict[str, Any], optim: torch.optim.Optimizer, fqns: dict[nn.Parameter, str]) -> dict:
    """The nested optimizer state_dict of ``optim``'s parameters from a flattened one."""
    state: dict[str, Any] = {}
    groups = []
    for group in optim.param_groups:
        names = [fqns[p] for p in group[_PARAMS]]
        for fqn in names:
            prefix = f"{_STATE}.{fqn}."
            for key, value in flat.items():
                if key.startswith(prefix):
                    *path, leaf = key[len(prefix):].split(".")
                    target = state.setdefault(fqn, {})
                    for part in path:
                        target = target.setdefault(part, {})
                    target[leaf] = value
        first = f"{_PG}.{names[0]}." if names else None
        saved = {k[len(first):]: v for k, v in flat.items() if first and k.startswith(first)}
        groups.append({**{k: v for k, v in group.items() if k != _PARAMS}, **saved, _PARAMS: names})
    return {_STATE: state, _PG: groups}


def _get_optim_state_dict(model: nn.Module, optimizers: tuple, options: StateDictOptions) -> dict[str, Any]:
    fqns = _param_fqns(model)
    out: dict[str, Any] = {_STATE: {}, _PG: []}
    for optim in optimizers:
        _init_optim_state(optim)
        with _fsdp1_state_dict_type(model, options) as fsdp1:
            if fsdp1:  # FSDP1 keys states by the original parameters' names itself, from its flat shards
                osd = FullyShardedDataParallel.optim_state_dict(model, optim)
                out[_STATE].update(osd[_STATE])
                out[_PG].extend(osd[_PG])
                continue
        osd = optim.state_dict()
        params = list(chain.from_iterable(group[_PARAMS] for group in optim.param_groups))
        pid_to_fqn = {pid: fqns[p] for pid, p in enumerate(params) if p in fqns}
        for pid in list(osd[_STATE]):
            out[_STATE][pid_to_fqn[pid]] = osd[_STATE][pid]
        for group in osd[_PG]:
            out[_PG].append({**group, _PARAMS: [pid_to_fqn[pid] for pid in group[_PARAMS]]})
    out = _finish(out, options)
    if options.flatten_optimizer_state_dict and out:
        out = _flatten_optim(out)
    return out


def _load_optim_state_dict(model: nn.Module, optimizers: tuple, osd: dict[str, Any],
                           options: StateDictOptions) -> None:
    fqns = _param_fqns(model)
    flat = bool(osd) and _STATE not in osd and _PG not in osd
    fsdp1 = bool(FullyShardedDataParallel.fsdp_modules(model))
    if fsdp1 and flat:
        raise ValueError("set_optimizer_state_dict: a flattened optimizer state_dict cannot be loaded into an FSDP1 "
                         "model; save it with flatten_optimizer_state_dict=False")
    for optim in optimizers:
        _init_optim_state(optim)
        current = optim.state_dict()
        mine = _unflatten_optim(osd, optim, fqns) if flat else osd
        if options.broadcast_from_rank0:
            box = [mine if get_rank() == 0 else None]
            broadcast_object_list(box, src=0)
            mine = box[0]
        if fsdp1:  # FSDP1 cuts the named states into its flat shards itself
            with _fsdp1_state_dict_type(model, options):
                optim.load_state_dict(FullyShardedDataParallel.optim_state_dict_to_load(model, optim, mine))
            continue
        params = list(chain.from_iterable(group[_PARAMS] for group in optim.param_groups))
        state, groups = {}, []
        for pid, param in enumerate(params):
            fqn = fqns[param]
            if fqn in mine[_STATE]:
                have = current[_STATE].get(pid, {})
                state[pid] = {k: _like(have.get(k), v) for k, v in mine[_STATE][fqn].items()}
        pid_of = {fqns[p]: pid for pid, p in enumerate(params)}
        for group in optim.param_groups:
            names = [fqns[p] for p in group[_PARAMS]]
            saved = next((g for g in mine[_PG] if names and names[0] in g[_PARAMS]), None)
            if saved is None:
                raise ValueError(f"set_optimizer_state_dict: no saved param group holds parameter {names[0]!r}; "
                                 "the optimizer state_dict does not match this optimizer's parameters")
            groups.append({**{k: v for k, v in saved.items() if k != _PARAMS}, _PARAMS: [pid_of[n] for n in names]})
        optim.load_state_dict({_STATE: state, _PG: groups})


# -- the public functions -----------------------------------------------------------------------------------------

def _options(options: StateDictOptions | None) -> StateDictOptions:
    options = options if options is not None else StateDictOptions()
    if options.broadcast_from_rank0 and not options.full_state_dict:
        raise ValueError("full_state_dict must be True when broadcast_from_rank0 is True.")
    return options


def get_model_state_dict(model: nn.Module, *, submodules: set[nn.Module] | None = None,
                         options: StateDictOptions | None = None) -> dict[str, Any]:
    """The model's state_dict keyed by FQN (no ``module.`` prefix of DDP)."""
    options = _options(options)
    with torch.no_grad(), _fsdp1_state_dict_type(model, options):
        state_dict = _unwrap_state_dict(model, model.state_dict())
    if submodules:
        warnings.warn("Getting submodules only model/optim state_dict is deprecated and will be removed in 2.5. "
                      "This feature can be achieved by manually filtering out the state_dict returned from "
                      "get_state_dict.", FutureWarning, stacklevel=2)
        prefixes = [f"{_fqn(model, name)}." for name, module in model.named_modules() if module in submodules]
        kept = {}
        for fqn, value in state_dict.items():
            for prefix in prefixes:
                if fqn.startswith(prefix):
                    kept[fqn if options.keep_submodule_prefixes else fqn[len(prefix):]] = value
        state_dict = kept
    if options.ignore_frozen_params:
        for name, param in model.named_parameters():
            if not param.requires_grad:
                state_dict.pop(_fqn(model, name), None)
    return _finish(state_dict, options)


def get_optimizer_state_dict(model: nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
                             *, submodules: set[nn.Module] | None = None,
                             options: StateDictOptions | None = None) -> dict[str, Any]:
    """The optimizers' state keyed by parameter FQN (several optimizers merge into one dict)."""
    return _get_optim_state_dict(model, _as_tuple(optimizers), _options(options))


def get_state_dict(model: nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer], *,
                   submodules: set[nn.Module] | None = None,
                   options: StateDictOptions | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(get_model_state_dict(...), get_optimizer_state_dict(...))``."""
    return (get_model_state_dict(model, submodules=submodules, options=options),
            get_optimizer_state_dict(model, optimizers, submodules=submodules, options=options))


def set_model_state_dict(model: nn.Module, model_state_dict: dict[str, Any], *,
                         options: StateDictOptions | None = None) -> _IncompatibleKeys:
    """Load an FQN-keyed state_dict into ``model`` (wrapped or not); returns ``load_state_dict``'s result."""
    options = _options(options)
    if not model_state_dict and not options.broadcast_from_rank0:
        return _IncompatibleKeys([], [])
    with _fsdp1_state_dict_type(model, options):
        return _set_model_state_dict(model, model_state_dict, options)


def _set_model_state_dict(model: nn.Module, model_state_dict: dict[str, Any],
                          options: StateDictOptions) -> _IncompatibleKeys:
    local = model.state_dict()
    if options.broadcast_from_rank0:
        model_state_dict = _broadcast_from_rank0(model_state_dict, [_fqn(model, k) for k in local])
    given = dict(model_state_dict)
    to_load: dict[str, Any] = {}
    for key, value in local.items():
        fqn = _fqn(model, key)
        if fqn in given:
            to_load[key] = _like(value, given.pop(fqn))
        elif options.strict and fqn != key:  # under a wrapper; load_state_dict would report the prefixed key
            raise RuntimeError(f"Missing key: {fqn}.")
    to_load.update(given)  # what matches nothing: load_state_dict reports it as unexpected
    # A whole state_dict loaded into a model on the meta device replaces its tensors (PyTorch's rule): copying
    # into meta tensors would keep nothing.
    assign = (options.full_state_dict or options.broadcast_from_rank0) and any(
        isinstance(v, torch.Tensor) and v.is_meta for v in local.values())
    with torch.no_grad():
        return model.load_state_dict(to_load, strict=options.strict, assign=assign)


def set_optimizer_state_dict(model: nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
                             optim_state_dict: dict[str, Any], *, options: StateDictOptions | None = None) -> None:
    """Load an FQN-keyed (or flattened) optimizer state_dict into ``optimizers``."""
    options = _options(options)
    if not optim_state_dict and not options.broadcast_from_rank0:
        return
    _load_optim_state_dict(model, _as_tuple(optimizers), optim_state_dict, options)


def set_state_dict(model: nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer], *,
                   model_state_dict: dict[str, Any], optim_state_dict: dict[str, Any],
                   options: StateDictOptions | None = None) -> _IncompatibleKeys:
    """The optimizers' state, then the model's (PyTorch's order); returns the model's incompatible keys."""
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return set_model_state_dict(model, model_state_dict, options=options)
