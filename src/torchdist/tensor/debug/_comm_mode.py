"""``CommDebugMode``: count the collectives a block of code issues, in total and per module, forward and backward.

Collectives reach the mode through ``torchdist._c10d.comm_report``: DTensor's redistributions report PyTorch's
functional collective names (``c10d_functional.all_gather_into_tensor``, ...), direct c10d calls the c10d op
names (``c10d.allreduce_``). Counts are keyed by the ``torch.ops`` overload packets PyTorch's own mode uses, so
``counts[torch.ops.c10d_functional.all_reduce]`` reads the same under both libraries. The legacy
``torch.ops.c10d_functional`` namespace only exists once ``torch.distributed._functional_collectives`` is
imported; until then a key is a :class:`CollectiveOp` with the same ``str``, and lookups accept either, the
native ``torch.ops._c10d_functional`` packets, or the name as a string.

The mode is also a ``TorchDispatchMode``, as PyTorch's is: it records every aten op run inside it per module
(with the shapes, placements and mesh of DTensor arguments), for ``generate_comm_debug_tracing_table`` and
``generate_json_dump``. ``noise_level``: 0 module collective counts, 1 also module types, parameters and DTensor
ops (not trivial ones), 2 also other non-trivial ops, 3 every op.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..._c10d import comm_report
from .._api import DTensor
from ._module_tracker import ModuleTracker

__all__ = ["CommDebugMode", "CollectiveOp"]

TRIVIAL_OPS = {"aten.detach.default", "aten.t.default", "aten.view.default", "aten._to_copy.default",
               "aten.as_strided.default", "aten.transpose.int"}
_NATIVE_NAMESPACES = {"_c10d_functional": "c10d_functional", "_c10d_functional_autograd": "c10d_functional"}
_ANSI = re.compile(r"\x1B\[[0-?]*[ -/]*[@-~]")


@dataclass(frozen=True)
class CollectiveOp:
    """Stands for ``torch.ops.<name>`` where that op is not registered in this process."""

    name: str

    def __str__(self) -> str:
        return self.name


def _canonical(key: Any) -> str:
    """``"c10d_functional.all_reduce"`` for that op's packet, overload, native twin, ``CollectiveOp`` or string."""
    key = getattr(key, "_overloadpacket", key)
    name = str(key).removeprefix("torch.ops.")
    namespace, _, op = name.partition(".")
    return f"{_NATIVE_NAMESPACES.get(namespace, namespace)}.{op}"


def _key_of(name: str) -> Any:
    """The ``torch.ops`` packet named ``name`` if registered, else a :class:`CollectiveOp`."""
    namespace, _, op = name.partition(".")
    try:
        return getattr(getattr(torch.ops, namespace), op)
    except (AttributeError, RuntimeError):
        return CollectiveOp(name)


class CommCounts(defaultdict):
    """Collective -> count; a key may be given as any form :func:`_canonical` understands."""

    def __init__(self) -> None:
        super().__init__(int)

    def _stored(self, key: Any) -> Any:
        try:
            if dict.__contains__(self, key):
                return key
        except TypeError:
            return key
        name = _canonical(key)
        return next((k for k in self.keys() if _canonical(k) == name), key)

    def __getitem__(self, key: Any) -> int:
        return super().__getitem__(self._stored(key))

    def __setitem__(self, key: Any, value: int) -> None:
        super().__setitem__(self._stored(key), value)

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, self._stored(key))

    def get(self, key: Any, default: Any = None) -> Any:
        return super().get(self._stored(key), default)


def _new_counts() -> dict[str, defaultdict]:
    return {"forward": defaultdict(int), "backward": defaultdict(int)}


class CommDebugMode(TorchDispatchMode):
    """Counts the collectives issued inside ``with CommDebugMode() as comm_mode:``, per op and per module.

    Example::

        comm_mode = CommDebugMode()
        with comm_mode:
            model(x).sum().backward()
        comm_mode.get_comm_counts()[torch.ops.c10d_functional.all_reduce]
        print(comm_mode.generate_comm_debug_tracing_table(noise_level=0))
    """

    def __init__(self) -> None:
        super().__init__()
        self.supports_higher_order_operators = True
        self.comm_counts: CommCounts = CommCounts()
        self.comm_module_counts: dict[str, dict[str, defaultdict]] = {}
        self.comm_module_operation_counts: dict[str, dict[str, list]] = {}
        self.advanced_module_tracker = ModuleTracker()

    # -- queries -----------------------------------------------------------------------------------------------
    def get_total_counts(self) -> int:
        return sum(self.comm_counts.values())

    def get_comm_counts(self) -> CommCounts:
        """Collective op -> how many times it ran (keys: ``torch.ops`` packets, see the module docstring)."""
        return self.comm_counts

    def get_parameter_info(self) -> dict[str, dict[str, Any]]:
        """Module name -> its own parameters (name -> data) for every module that ran."""
        return self.advanced_module_tracker.module_parameters_dict

    def get_sharding_info(self) -> dict[str, Any]:
        """``"<module>.<parameter>"`` -> placements, for every DTensor parameter of a module that ran."""
        return self.advanced_module_tracker.sharding_dict

    def __repr__(self) -> str:
        return f"CommDebugMode(get_total_counts()={self.get_total_counts()})"

    # -- recording ---------------------------------------------------------------------------------------------
    def __enter__(self) -> CommDebugMode:
        self.comm_counts.clear()
        self.comm_module_counts.clear()
        self.comm_module_counts["Global"] = _new_counts()
        self.comm_module_operation_counts.clear()
        super().__enter__()
        self.advanced_module_tracker.__enter__()
        comm_report.add_listener(self._on_collective)
        return self

    def __exit__(self, *exc: Any) -> None:
        comm_report.remove_listener(self._on_collective)
        self.advanced_module_tracker.__exit__(*exc)
        super().__exit__(*exc)

    def _operation(self, func: Any) -> dict[str, Any]:
        tracker = self.advanced_module_tracker
        operation = {"name": func, "input_shape": [], "input_sharding": [], "device_mesh": "",
                     "is_bw": tracker.is_bw, "is_activation_checkpointing": tracker.activation_checkpointing}
        self.comm_module_operation_counts.setdefault(tracker.name, {"operations_list": []})[
            "operations_list"].append(operation)
        return operation

    def _on_collective(self, name: str) -> None:
        """comm_report's listener: count ``name`` for the mode, the running module and its ancestors."""
        key = self.comm_counts._stored(_key_of(name))
        self.comm_counts[key] += 1
        tracker = self.advanced_module_tracker
        phase = "backward" if tracker.is_bw else "forward"
        self.comm_module_counts.setdefault(tracker.name, _new_counts())[phase][key] += 1
        for parent in tracker.module_parents_dict.get(tracker.name, ()):
            if parent != tracker.name:
                self.comm_module_counts.setdefault(parent, _new_counts())[phase][key] += 1
        self._operation(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        operation = self._operation(func)
        if any(issubclass(t, DTensor) for t in types):
            for arg in args:
                if isinstance(arg, DTensor):
                    operation["input_shape"].append(arg.shape)
                    operation["input_sharding"].append(arg.placements)
                    operation["device_mesh"] = str(arg.device_mesh)
            return NotImplemented  # let DTensor run it (and report its collectives); its local ops come back here
        return func(*args, **kwargs)

    # -- reports -----------------------------------------------------------------------------------------------
    @staticmethod
    def _noise(noise_level: int) -> tuple[bool, bool, bool]:
        """(DTensor ops and module data, all non-trivial ops, trivial ops too)."""
        return noise_level > 0, noise_level > 1, noise_level > 2

    def _operations(self, fqn: str) -> tuple[list, list, list]:
        """(forward, backward, activation checkpointing) operations of module ``fqn``."""
        ops = self.comm_module_operation_counts.get(fqn, {"operations_list": []})["operations_list"]
        return ([op for op in ops if not op["is_bw"]],
                [op for op in ops if op["is_bw"] and not op["is_activation_checkpointing"]],
                [op for op in ops if op["is_activation_checkpointing"]])

    @staticmethod
    def _shown(op: dict[str, Any], noise_level: int) -> bool:
        dtensor_ops, all_ops, trivial = CommDebugMode._noise(noise_level)
        name = str(op["name"])
        return trivial or (all_ops and name not in TRIVIAL_OPS) or (
            dtensor_ops and name not in TRIVIAL_OPS and len(op["input_shape"]) > 0)

    def generate_comm_debug_tracing_table(self, noise_level: int = 3) -> str:
        """Per module (indented by depth): type and parameters, then forward/backward collective counts and
        operations; the detail grows with ``noise_level`` (module docstring). ANSI colours as PyTorch's."""
        dtensor_ops, _, _ = self._noise(noise_level)
        helper = self.advanced_module_tracker.module_helper_dict
        lines: list[str] = []
        for fqn, info in helper.items():
            indent = "  " * (2 * info["depth"])
            lines.append(f"{indent}{fqn}")
            if dtensor_ops and "module_type" in info:
                lines.append(f"{indent}*module type: {info['module_type']}")
            if dtensor_ops and "parameters" in info:
                lines.append(f"{indent}*Parameter List")
                lines.extend(f"{indent} *{name}: {placement}" for name, placement in info["parameters"].items())
            indent += "  "
            comm_indent = "  " * (2 * info["depth"] + 2)
            op_indent = "  " * (2 * info["depth"] + 3)
            counts = self.comm_module_counts.get(fqn, _new_counts())
            forward, backward, checkpointing = self._operations(fqn) if dtensor_ops else ([], [], [])

            def trace(collectives: dict, operations: list) -> None:
                lines.extend(f"\033[1;33m{comm_indent}*{op}: {n}\033[0m" for op, n in collectives.items())
                for op in operations:
                    if not self._shown(op, noise_level):
                        continue
                    lines.append(f"\033[1;33m{comm_indent}**{op['name']}\033[0m")
                    if op["input_shape"]:
                        lines.append(f"\033[1;31m{op_indent}shape: {op['input_shape']}\033[0m")
                        lines.append(f"\033[1;31m{op_indent}sharding: {op['input_sharding']}\033[0m")
                        lines.append(f"\033[1;31m{op_indent}device mesh: {op['device_mesh']}\033[0m")

            for title, collectives, operations in (("FORWARD PASS", counts["forward"], forward),
                                                   ("BACKWARD PASS", counts["backward"], backward)):
                if collectives or operations:
                    lines.append(f"{indent}{title}")
                    trace(collectives, operations)
            if checkpointing:
                lines.append(f"{indent}ACTIVATION CHECKPOINTING")
                trace({}, checkpointing)
        return "".join(line + "\n" for line in lines)

    def log_comm_debug_tracing_table_to_file(self, file_name: str = "comm_mode_log.txt",
                                             noise_level: int = 3) -> None:
        """The tracing table without colours, written to ``file_name``."""
        with open(file_name, "w") as log_file:
            log_file.write(_ANSI.sub("", self.generate_comm_debug_tracing_table(noise_level)))

    def generate_json_dump(self, file_name: str = "comm_mode_log.json", noise_level: int = 3) -> None:
        """The module tree (from ``"Global"``) with each module's type, parameters, collectives and operations,
        as JSON in ``file_name`` (the input of PyTorch's browser visualiser)."""
        dtensor_ops, all_ops, trivial = self._noise(noise_level)
        tracker = self.advanced_module_tracker

        def describe(op: dict[str, Any]) -> dict[str, Any]:
            return {"name": str(op["name"]), "input_shape": [str(s) for s in op["input_shape"]],
                    "input_sharding": [str(p) for p in op["input_sharding"]], "device_mesh": op["device_mesh"],
                    "is_bw": op["is_bw"], "is_activation_checkpointing": op["is_activation_checkpointing"]}

        def keep(operations: list) -> list:
            if not all_ops:
                operations = [op for op in operations if op["input_sharding"]]
            if not trivial:
                operations = [op for op in operations if str(op["name"]) not in TRIVIAL_OPS]
            return [describe(op) for op in operations]

        def node(fqn: str) -> dict[str, Any]:
            info = tracker.module_helper_dict.get(fqn, {})
            counts = self.comm_module_counts.get(fqn, _new_counts())
            forward, backward, checkpointing = self._operations(fqn) if dtensor_ops else ([], [], [])
            return {
                "fqn": fqn,
                "module_type": info.get("module_type", "") if dtensor_ops else "",
                "parameters": list(info.get("parameters", {}).items()) if dtensor_ops else [],
                "children": [node(child) for child in tracker.parent_dict.get(fqn, [])],
                "collectives_forward": [(str(op), n) for op, n in counts["forward"].items()],
                "collectives_backward": [(str(op), n) for op, n in counts["backward"].items()],
                "operations_forward": keep(forward),
                "operations_backward": keep(backward),
                "operations_checkpointing": keep(checkpointing),
            }

        with open(file_name, "w") as json_file:
            json.dump(node("Global"), json_file, indent=4)
