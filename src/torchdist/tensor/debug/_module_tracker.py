"""Which module is running: the module tracker behind ``CommDebugMode``'s per-module counts.

PyTorch's ``CommDebugMode`` uses ``torch.distributed._tools.ModTracker`` extended with parameter and parent
bookkeeping; this is the same thing built on ``torch.nn``'s global module hooks and autograd's multi-grad hooks,
keeping its names and semantics:

* a module is named by its path from the first module seen running (``"MLP.net1"``; the root by its class),
  the outermost scope is ``"Global"``;
* ``parents``: the modules whose forward (or backward) is running; ``is_bw``: whether autograd is running;
* forward:  pre-hook  -> the module enters ``parents`` and becomes ``name``; its parameters and their placements
  are recorded; post-hook -> it leaves ``parents``, and a hook on its outputs' gradients puts it back when its
  backward starts; after the module's own forward hooks ``name`` goes back to its parent;
* backward: the full-backward pre-hook makes it ``name``; a hook on its inputs' gradients takes it out of
  ``parents`` when its backward is done (and an engine callback resets ``parents`` after every backward).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import (register_module_forward_hook, register_module_forward_pre_hook,
                                     register_module_full_backward_pre_hook)
from torch.utils._pytree import tree_flatten

from .._api import DTensor

__all__ = ["ModuleTracker"]


def _grad_tensors(value: Any) -> list[torch.Tensor]:
    return [a for a in tree_flatten(value)[0] if isinstance(a, torch.Tensor) and a.requires_grad]


class ModuleTracker:
    """Tracks the running module (``name``), its ancestors (``parents``) and what each module holds.

    ``module_helper_dict``: per module name, its type, depth and parameter placements (in order of first run);
    ``module_parameters_dict``: its parameters; ``sharding_dict``: ``"<module>.<param>"`` -> placements of the
    DTensor parameters; ``module_parents_dict``: the ``parents`` when it first ran; ``parent_dict``: its children.
    """

    def __init__(self) -> None:
        self.parents: set[str] = {"Global"}
        self.name = "Global"
        self.activation_checkpointing = False
        self.module_helper_dict: dict[str, dict[str, Any]] = {}
        self.module_parameters_dict: dict[str, dict[str, Any]] = {}
        self.module_parents_dict: dict[str, set[str]] = {}
        self.parent_dict: dict[str, list[str]] = {}
        self.parent_list: list[str] = ["Global"]
        self.sharding_dict: dict[str, Any] = {}
        self._active: dict[str, int] = {}
        self._known: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._seen: weakref.WeakSet = weakref.WeakSet()
        self._has_callback = False
        self._handles: list = []

    @property
    def is_bw(self) -> bool:
        return torch._C._current_graph_task_id() != -1

    # -- names and the parents set -----------------------------------------------------------------------------
    def _mod_name(self, mod: torch.nn.Module) -> str:
        if mod not in self._known:
            self._known[mod] = type(mod).__name__
        name = self._known[mod]
        if mod not in self._seen:
            for child_name, child in mod.named_children():
                self._known[child] = f"{name}.{child_name}"
                self._mod_name(child)
            self._seen.add(mod)
        return name

    def _set_engine_callback(self) -> None:
        if self._has_callback:
            return

        def reset() -> None:
            self.parents = {"Global"}
            self._has_callback = False

        torch.autograd.Variable._execution_engine.queue_callback(reset)
        self._has_callback = True

    def _enter_fn(self, name: str, is_bw: bool) -> Callable[..., None]:
        def enter(*_: Any) -> None:
            if is_bw:
                self._set_engine_callback()
            if name not in self.parents:
                self._active[name] = 1
                self.parents.add(name)
            else:
                self._active[name] += 1
        return enter

    def _leave_fn(self, name: str) -> Callable[..., None]:
        def leave(*_: Any) -> None:
            if name in self.parents:
                self._active[name] -= 1
                if self._active[name] == 0:
                    self.parents.remove(name)
        return leave

    # -- hooks -------------------------------------------------------------------------------------------------
    def _fw_pre_hook(self, mod: torch.nn.Module, inputs: Any) -> None:
        self.activation_checkpointing = self.is_bw  # a forward inside backward: recomputation
        self.name = self._mod_name(mod)
        self._enter_fn(self.name, False)()
        tensors = _grad_tensors(inputs)
        if not self.is_bw and tensors:
            register_multi_grad_hook(tensors, self._leave_fn(self.name))
        if self.activation_checkpointing:
            return
        info = self.module_helper_dict.setdefault(self.name, {})
        info["module_type"] = str(type(mod)).replace("<", "").replace(">", "")
        info["depth"] = len(self.parents) - 1
        for param_name, param in mod.named_parameters(recurse=False):
            self.module_parameters_dict.setdefault(self.name, {})[param_name] = param.data
            if isinstance(param.data, DTensor):
                self.sharding_dict[f"{self.name}.{param_name}"] = param.data.placements
                info.setdefault("parameters", {})[param_name] = str(param.data.placements)
        self.module_parents_dict.setdefault(self.name, set(self.parents))
        self.parent_dict.setdefault(self.parent_list[-1], []).append(self.name)
        self.parent_list.append(self.name)
        # The module stays ``name`` until its own forward hooks (tensor parallelism's output redistribution) ran:
        # global hooks run before a module's own, so the hand-back is a hook of the module, registered last.
        handle = mod.register_forward_hook(lambda *_: self._fw_done(handle), always_call=True)
        self._handles.append(handle)

    def _fw_done(self, handle: Any) -> None:
        handle.remove()
        self.activation_checkpointing = self.is_bw
        if not self.activation_checkpointing and len(self.parent_list) > 1:
            self.parent_list.pop()
            self.name = self.parent_list[-1]

    def _fw_post_hook(self, mod: torch.nn.Module, inputs: Any, output: Any) -> None:
        name = self._mod_name(mod)
        self._leave_fn(name)()
        tensors = _grad_tensors(output)
        if not self.is_bw and tensors:
            register_multi_grad_hook(tensors, self._enter_fn(name, True), mode="any")

    def _bw_pre_hook(self, mod: torch.nn.Module, grad_output: Any) -> None:
        self.activation_checkpointing = False
        self.name = self._mod_name(mod)

    def __enter__(self) -> ModuleTracker:
        self.activation_checkpointing = False
        for table in (self.module_parameters_dict, self.sharding_dict, self.parent_dict, self.module_helper_dict,
                      self.module_parents_dict):
            table.clear()
        self.parent_list = ["Global"]
        self.module_helper_dict["Global"] = {"depth": 0}
        self.module_parents_dict["Global"] = set()
        self.name = "Global"
        self._handles = [register_module_forward_pre_hook(self._fw_pre_hook),
                         register_module_forward_hook(self._fw_post_hook, always_call=True),
                         register_module_full_backward_pre_hook(self._bw_pre_hook)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
