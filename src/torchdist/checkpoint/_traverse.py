"""Nested state_dicts <-> flat ``{"a.b.0": leaf}`` dicts, with the path of each flat key kept to undo it.

The rule (PyTorch's): a mapping is always entered; a list is entered only when
it holds a tensor or a container that is entered; anything else (tuples,
tensor-free lists, scalars, strings) is one leaf, saved as bytes. An empty
mapping therefore leaves no key at all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ._chunks import is_tensor_like

OBJ_PATH = tuple[str | int, ...]
FLATTEN_MAPPING = dict[str, OBJ_PATH]


def _is_leaf(value: Any) -> bool:
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    return not any(is_tensor_like(v) or (isinstance(v, (Mapping, list)) and not _is_leaf(v)) for v in value)


def traverse_state_dict(state_dict: Mapping[str, Any], visitor: Callable[[OBJ_PATH, Any], None]) -> None:
    """Call ``visitor(path, leaf)`` for every leaf, in insertion order."""

    def visit(path: OBJ_PATH, value: Any) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                visit(path + (str(key),), item)
        elif _is_leaf(value):
            visitor(path, value)
        else:
            for i, item in enumerate(value):
                visit(path + (i,), item)

    for key, value in state_dict.items():
        visit((str(key),), value)


def flatten_state_dict(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], FLATTEN_MAPPING]:
    """The flat dict (keys joined by dots) and each flat key's path."""
    flat: dict[str, Any] = {}
    mapping: FLATTEN_MAPPING = {}

    def keep(path: OBJ_PATH, value: Any) -> None:
        key = ".".join(map(str, path))
        if key in flat:
            raise ValueError(f"checkpoint: two entries of the state_dict flatten to the same key {key!r}; "
                             "rename one of them")
        flat[key] = value
        mapping[key] = path

    traverse_state_dict(state_dict, keep)
    return flat, mapping


def set_element(root: dict, path: OBJ_PATH, value: Any) -> None:
    """Put ``value`` at ``path`` in ``root``, creating dicts (for str keys) and lists (for int keys) on the way."""
    container: Any = root
    for key, next_key in zip(path[:-1], path[1:]):
        fresh = [] if isinstance(next_key, int) else {}
        if isinstance(container, list):
            container.extend([None] * (key + 1 - len(container)))
            if container[key] is None:
                container[key] = fresh
        elif key not in container:
            container[key] = fresh
        container = container[key]
    last = path[-1]
    if isinstance(container, list):
        container.extend([None] * (last + 1 - len(container)))
    container[last] = value


def unflatten_state_dict(flat: Mapping[str, Any], mapping: FLATTEN_MAPPING) -> dict[str, Any]:
    """Rebuild the nested dict from ``flatten_state_dict``'s output."""
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        set_element(nested, mapping[key], value)
    return nested
