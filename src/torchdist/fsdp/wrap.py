"""Which submodules become their own FSDP unit (``torch.distributed.fsdp.wrap``): auto-wrap policies, and the
``enable_wrap`` / ``wrap`` annotations for wrapping by hand.

Two kinds of policy, as in PyTorch:

- a callable ``policy(module, recurse, nonwrapped_numel) -> bool``: asked with
  ``recurse=True`` whether to look inside ``module``, and with ``recurse=False``
  whether to wrap it, given the numel its wrapped children did not take
  (``size_based_auto_wrap_policy``, ``transformer_auto_wrap_policy``, ...); it is
  run bottom-up by ``_recursive_wrap``;
- a ``_Policy`` object (``ModuleWrapPolicy``, ``CustomPolicy``) that names the
  target modules (and per-module constructor overrides) in one pass; the
  targets are then wrapped children first.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from abc import ABC, abstractmethod
from typing import Any, Callable, Generator, Iterable, Sequence

import torch.nn as nn

__all__ = [
    "always_wrap_policy",
    "lambda_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "enable_wrap",
    "wrap",
    "CustomPolicy",
    "ModuleWrapPolicy",
]


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Wrap every module that has parameters of its own (children first)."""
    return True


class _Policy(ABC):
    """A policy that names its target modules up front: ``{module: constructor kwargs}``."""

    @abstractmethod
    def _run_policy(self, root_module: nn.Module, ignored_modules: set[nn.Module],
                    root_kwargs: dict[str, Any]) -> dict[nn.Module, dict[str, Any]]:
        ...


def _module_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                        module_classes: set[type[nn.Module]]) -> bool:
    return True if recurse else isinstance(module, tuple(module_classes))


class ModuleWrapPolicy(_Policy):
    """Wrap every module that is an instance of one of ``module_classes``."""

    def __init__(self, module_classes: Iterable[type[nn.Module]]) -> None:
        self._module_classes = set(module_classes)
        self._module_classes_str = str(self._module_classes)

    def _run_policy(self, root_module: nn.Module, ignored_modules: set[nn.Module],
                    root_kwargs: dict[str, Any]) -> dict[nn.Module, dict[str, Any]]:
        classes = tuple(self._module_classes)
        return {module: copy.copy(root_kwargs) for module in root_module.modules()
                if module not in ignored_modules and isinstance(module, classes)}

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        # as a callable policy (for ``_recursive_wrap``, e.g. under ``enable_wrap``)
        return _module_wrap_policy(module, recurse, nonwrapped_numel=-1, module_classes=self._module_classes)

    def __repr__(self) -> str:
        return super().__repr__() + f"({self._module_classes_str})"


class CustomPolicy(_Policy):
    """Wrap the modules for which ``lambda_fn(module)`` is True, or a dict of constructor overrides."""

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | dict[str, Any]]) -> None:
        self._lambda_fn = lambda_fn

    def _run_policy(self, root_module: nn.Module, ignored_modules: set[nn.Module],
                    root_kwargs: dict[str, Any]) -> dict[nn.Module, dict[str, Any]]:
        targets: dict[nn.Module, dict[str, Any]] = {}
        for module in root_module.modules():
            if module in ignored_modules:
                continue
            res = self._lambda_fn(module)
            if not isinstance(res, (dict, bool)):
                raise ValueError("The lambda_fn passed to CustomPolicy should return "
                                 f"False/True or a kwarg dict, but it returned {res}")
            if not res:
                continue
            kwargs = copy.copy(root_kwargs)
            if isinstance(res, dict):
                kwargs.update(res)
            targets[module] = kwargs
        return targets


def lambda_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                            lambda_fn: Callable[[nn.Module], bool]) -> bool:
    """Wrap the modules for which ``lambda_fn(module)`` is True (use with ``functools.partial``)."""
    return True if recurse else lambda_fn(module)


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                 transformer_layer_cls: set[type[nn.Module]]) -> bool:
    """Wrap every instance of ``transformer_layer_cls`` (use with ``functools.partial``)."""
    return _module_wrap_policy(module, recurse, nonwrapped_numel, transformer_layer_cls)


def _wrap_module_cls_individually(module: nn.Module, module_classes: Sequence, recurse: bool,
                                  *args: Any, **kwargs: Any) -> bool:
    return True if recurse else isinstance(module, tuple(module_classes))


def _or_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int, policies: list) -> bool:
    return any(policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel) for policy in policies)


def size_based_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                min_num_params: int = int(1e8), force_leaf_modules: set | None = None,
                                exclude_wrap_modules: set | None = None) -> bool:
    """Wrap a module once the parameters its wrapped children left reach ``min_num_params``; never look inside
    ``force_leaf_modules``, never wrap ``exclude_wrap_modules`` (containers)."""
    force_leaf = size_based_auto_wrap_policy.FORCE_LEAF_MODULES if force_leaf_modules is None else force_leaf_modules
    exclude = (size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES if exclude_wrap_modules is None
               else exclude_wrap_modules)
    if recurse:
        return not isinstance(module, tuple(force_leaf))
    return nonwrapped_numel >= min_num_params and not isinstance(module, tuple(exclude))


size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}  # type: ignore[attr-defined]
size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}  # type: ignore[attr-defined]


class _ConfigAutoWrap:
    """The ``enable_wrap`` context: the wrapper class and its kwargs that ``wrap`` applies (one level only)."""

    in_autowrap_context: bool = False
    wrapper_cls: Callable | None = None
    kwargs: dict[str, Any] = {}

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    def __enter__(self) -> None:
        if _ConfigAutoWrap.in_autowrap_context:
            raise NotImplementedError("You are already within an autowrap context and we currently do not supported "
                                      "nested autowrap.")
        kwargs = dict(self.kwargs)
        if "wrapper_cls" not in kwargs:
            raise AssertionError("Expected to pass in wrapper_cls arg into _ConfigAutoWrap.")
        _ConfigAutoWrap.in_autowrap_context = True
        _ConfigAutoWrap.wrapper_cls = kwargs.pop("wrapper_cls")
        _ConfigAutoWrap.kwargs = kwargs

    def __exit__(self, *exc: Any) -> None:
        _ConfigAutoWrap.in_autowrap_context = False
        _ConfigAutoWrap.wrapper_cls = None
        _ConfigAutoWrap.kwargs = {}


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Any, **wrapper_kwargs: Any) -> Generator[None, None, None]:
    """Within this context, ``wrap(module)`` wraps with ``wrapper_cls(module, **wrapper_kwargs)``."""
    with _ConfigAutoWrap(wrapper_cls=wrapper_cls, **wrapper_kwargs):
        yield


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Wrap ``module`` if inside ``enable_wrap`` (``wrap_overrides`` override its kwargs), else return it as is."""
    if _ConfigAutoWrap.in_autowrap_context:
        if _ConfigAutoWrap.wrapper_cls is None:
            raise AssertionError("wrapper_cls is not set in the autowrap context")
        return _wrap(module, _ConfigAutoWrap.wrapper_cls, **{**_ConfigAutoWrap.kwargs, **wrap_overrides})
    return module


def _wrap(module: nn.Module, wrapper_cls: Callable, **kwargs: Any) -> nn.Module:
    if hasattr(module, "_wrap_overrides"):  # a module may carry its own overrides, as in PyTorch
        kwargs = {**kwargs, **module._wrap_overrides}
    return wrapper_cls(module, **kwargs)


def _recursive_wrap(module: nn.Module, wrap_policy: Callable, wrapper_cls: Callable,
                    ignored_modules: set[nn.Module], ignored_params: set[nn.Parameter],
                    only_wrap_children: bool = False, **kwargs: Any) -> tuple[nn.Module, int]:
    """Wrap ``module``'s subtree bottom-up with a callable policy; returns (the module or its wrapper, the numel
    it wrapped)."""
    if module in ignored_modules:
        return module, 0
    nonwrapped_numel = sum(p.numel() for p in module.parameters()
                           if p not in ignored_params and not getattr(p, "_fsdp_flattened", False))
    if not wrap_policy(module=module, recurse=True, nonwrapped_numel=nonwrapped_numel):
        return module, 0
    total_wrapped = 0
    for name, child in module.named_children():
        if child in ignored_modules:
            continue
        wrapped_child, num_wrapped = _recursive_wrap(child, wrap_policy, wrapper_cls, ignored_modules,
                                                     ignored_params, **kwargs)
        setattr(module, name, wrapped_child)
        total_wrapped += num_wrapped
    remainder = nonwrapped_numel - total_wrapped
    if not only_wrap_children and wrap_policy(module=module, recurse=False, nonwrapped_numel=remainder):
        return _wrap(module, wrapper_cls, **kwargs), nonwrapped_numel
    return module, total_wrapped


def _post_order_apply(root: nn.Module, fn: Callable[[nn.Module], nn.Module | None]) -> None:
    """Replace each module below ``root`` by ``fn(module)`` when not None, children before parents."""
    visited = {root}

    def visit(module: nn.Module, name: str, parent: nn.Module | None) -> None:
        for child_name, child in list(module.named_children()):
            if child not in visited:
                visited.add(child)
                visit(child, child_name, module)
        replacement = fn(module)
        if replacement is not None and parent is not None:
            setattr(parent, name, replacement)

    visit(root, "", None)


def _auto_wrap(root: nn.Module, policy: Callable | _Policy, ignored_modules: set[nn.Module],
               ignored_params: set[nn.Parameter], root_kwargs: dict[str, Any], wrapper_cls: Callable) -> None:
    """Wrap the submodules of ``root`` that ``policy`` picks (``root`` itself is wrapped by the caller)."""
    mixed_precision = root_kwargs.get("mixed_precision")
    if isinstance(policy, _Policy):
        root_kwargs["auto_wrap_policy"] = None
        targets = policy._run_policy(root, ignored_modules, root_kwargs)
        if mixed_precision is not None:  # e.g. BatchNorm: its own unit, in full precision
            for module in root.modules():
                classes = tuple(mixed_precision._module_classes_to_ignore)
                if module not in ignored_modules and isinstance(module, classes):
                    targets[module] = {**root_kwargs, "mixed_precision": None}
        _post_order_apply(root, lambda m: wrapper_cls(m, **targets[m]) if m in targets and m is not root else None)
        return
    if mixed_precision is not None:
        classes = mixed_precision._module_classes_to_ignore
        policy = functools.partial(_or_policy, policies=[policy, functools.partial(
            _wrap_module_cls_individually, module_classes=classes)])
    root_kwargs["auto_wrap_policy"] = None
    _recursive_wrap(root, policy, wrapper_cls, ignored_modules, ignored_params, only_wrap_children=True,
                    **root_kwargs)
