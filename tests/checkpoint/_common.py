"""Shared by the checkpoint tests: sample state_dicts, a deep comparison, and the two DCP modules side by side."""

from __future__ import annotations

import importlib
import warnings

import torch


def sample_state() -> dict:
    """Nested dicts and lists, tensors of several dtypes and layouts, and non-tensor values of several kinds."""
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    return {
        "weight": torch.arange(12.0).reshape(3, 4),
        "view": base[1:3, ::2],  # a non-contiguous view into a larger storage
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
        "ints": torch.arange(5, dtype=torch.int32),
        "flags": torch.tensor([True, False, True]),
        "nested": {"a": {"b": torch.ones(2, 2) * 7}, "step": 11, "name": "adam", "none": None},
        "mixed_list": [torch.full((2,), 2.0), 5, {"deep": torch.tensor([1, 2, 3])}],
        "plain_list": [1, 2, 3],
        "tuple": (1, "x"),
        "int_keys": {0: torch.tensor([4.0]), 1: "one"},
        "empty_dict": {},
    }


def blank_like(value):
    """The same structure with tensors zeroed (new storage) and non-tensors replaced by a placeholder."""
    if isinstance(value, dict):
        return {k: blank_like(v) for k, v in value.items()}
    if isinstance(value, list):
        return [blank_like(v) for v in value]
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    return "placeholder"


def assert_same(got, want, where="state_dict"):
    """Equal structure, key order, tensor dtype/shape/values, and equal non-tensors."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, dict):
        assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: {got} != {want}"
        assert torch.equal(got, want), f"{where}: {got} != {want}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def quiet(fn, *args, **kwargs):
    """``fn(...)`` with the "no process group, single process" warnings both libraries give silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def outcome(fn, *args, **kwargs):
    """("ok", result) or (exception type name, the type and text of each rank's wrapped failure)."""
    try:
        return "ok", quiet(fn, *args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException, as in PyTorch
        failures = getattr(exc, "failures", None)
        if failures is not None:
            return type(exc).__name__, {r: (type(e).__name__, str(e)) for r, (e, _) in failures.items()}
        return type(exc).__name__, str(exc)


def lib_modules(lib: str, *names: str) -> tuple:
    """The modules ``<lib>.<name>`` for ``names`` (``lib``: "torch" or "torchdist", as torch.distributed's
    counterpart), then the c10d module; PyTorch's process group is made here (gloo)."""
    warnings.simplefilter("ignore")
    prefix = "torch.distributed" if lib == "torch" else "torchdist"
    c10d = importlib.import_module(prefix)
    if lib == "torch":
        c10d.init_process_group("gloo")
    return (*(importlib.import_module(f"{prefix}.{name}") for name in names), c10d)
